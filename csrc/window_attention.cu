// Swin's whole window attention in one kernel each way, on tensor cores, for windows of up to 64 tokens (window 7)
// and head dim 32 in half or bfloat16: out = softmax(q k^T * scale + bias[head] + mask[window]) @ v.
//
// q, k and v are read straight from the qkv projection (B_, N, 3C) and the output is written as (B_, N, C), ready
// for the output projection: no head permutes, no (B_, heads, N, N) tensor in memory. A block owns one head and walks
// a strided set of windows, so the head's (N, N) bias is read once, and in the backward its gradient is summed in
// registers across those windows before one atomic add per (i, j). The next window's tiles are fetched into registers
// while the current one computes. Each warp owns a 16-row stripe of the (padded) 64 x 64 score matrix. The forward
// saves the row log-sum-exp; the backward recomputes P from it and takes the softmax's row term from P * dP, so the
// output is not needed.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>
#include <torch/extension.h>

#include <algorithm>

namespace {

using namespace nvcuda;

constexpr int kD = 32;            // head dim
constexpr int kNP = 64;           // tokens, padded to the tensor-core tile
constexpr int kWarps = kNP / 16;  // one warp per 16-row stripe
constexpr int kThreads = kWarps * 32;
// Softmax work: two lanes per score row, each holding kPairs column pairs (j, j + 1) with j = 4k + 2 * (lane & 1).
constexpr int kPairs = kNP / 4;
// Padded shared-memory strides (elements) against bank conflicts (the two lanes of a score row read 8-byte pairs:
// a float stride of 68 spreads 8 rows over all 32 banks); all keep 32-byte tile alignment.
constexpr int kLdX = kD + 8;
constexpr int kLdP = kNP + 8;
constexpr int kLdS = kNP + 4;
constexpr int kLdO = kD + 4;  // float stripes of (16 x kD) results
constexpr int kVectors = kD / 8;  // 16-byte vectors per head row

template <typename T>
using FragA = wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major>;
template <typename T>
using FragAt = wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::col_major>;  // a transposed operand
template <typename T>
using FragB = wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major>;
template <typename T>
using FragBt = wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major>;
using FragC = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;


__device__ __forceinline__ void to2(float a, float b, __half* out) {
  *reinterpret_cast<__half2*>(out) = __floats2half2_rn(a, b);
}
__device__ __forceinline__ void to2(float a, float b, __nv_bfloat16* out) {
  *reinterpret_cast<__nv_bfloat162*>(out) = __floats2bfloat162_rn(a, b);
}

__device__ __forceinline__ int pair_column(int k, int lane) { return 4 * k + 2 * (lane & 1); }

constexpr int align128(int bytes) { return (bytes + 127) / 128 * 128; }

// Shared memory: `tiles` head tiles (kNP x kD), `full` score-sized tiles (kNP x kNP: the backward's P and dS), the
// block's bias + mask (kNP x kLdS floats, -inf outside N x N), then per warp a float scratch stripe.
struct Layout {
  int tiles, full, stripe, N;
  __host__ __device__ static constexpr int tile_bytes() { return align128(kNP * kLdX * 2); }
  __host__ __device__ static constexpr int full_bytes() { return align128(kNP * kLdP * 2); }
  __host__ __device__ int full_offset() const { return tiles * tile_bytes(); }
  __host__ __device__ int bias_offset() const { return full_offset() + full * full_bytes(); }
  __host__ __device__ int scratch_offset() const { return bias_offset() + align128(kNP * kLdS * 4); }
  __host__ __device__ int bytes() const { return scratch_offset() + kWarps * stripe; }
};

constexpr int kScoreStripe = align128(16 * kLdS * 4);
// The forward's stripe holds the scores, then P (as T) over them, then the output beside P.
constexpr int kForwardStripe = align128(std::max(kScoreStripe, 16 * kLdP * 2 + 16 * kLdO * 4));
constexpr Layout forward_layout(int N) { return {3, 0, kForwardStripe, N}; }
constexpr Layout backward_layout(int N) { return {4, 2, kScoreStripe, N}; }

// `kCount` head tiles of one window in flight: rows [0, N) from global memory, the padding rows as zeros. Row r of
// matrix m starts at src + m * matrix_offset + r * row_stride.
template <int kCount>
struct Staged {
  static constexpr int kPerThread = kCount * kNP * kVectors / kThreads;
  static_assert(kCount * kNP * kVectors % kThreads == 0, "tiles must split evenly over the threads");
  uint4 part[kPerThread];

  template <typename T>
  __device__ void fetch(const T* src, int64_t matrix_offset, int64_t row_stride, int N) {
#pragma unroll
    for (int e = 0; e < kPerThread; ++e) {
      const int v = threadIdx.x + e * kThreads;
      const int m = v / (kNP * kVectors), r = (v / kVectors) % kNP, c = (v % kVectors) * 8;
      part[e] = r < N ? __ldg(reinterpret_cast<const uint4*>(src + m * matrix_offset + r * row_stride + c))
                      : make_uint4(0, 0, 0, 0);
    }
  }

  template <typename T>
  __device__ void store(T* tiles, int tile_elems) const {
#pragma unroll
    for (int e = 0; e < kPerThread; ++e) {
      const int v = threadIdx.x + e * kThreads;
      const int m = v / (kNP * kVectors), r = (v / kVectors) % kNP, c = (v % kVectors) * 8;
      *reinterpret_cast<uint4*>(tiles + m * tile_elems + r * kLdX + c) = part[e];
    }
  }
};

// A warp's 16 x kD float stripe (stride kLdO) to global rows i0.. (< N) as T, 16 bytes per store.
template <typename T>
__device__ void store_stripe(const float* stripe, T* dst, int64_t row_stride, int i0, int N, float factor) {
  const int lane = threadIdx.x % 32;
  for (int e = lane; e < 16 * kVectors; e += 32) {
    const int r = e / kVectors, c = (e % kVectors) * 8;
    if (i0 + r >= N) continue;
    const float4 lo = *reinterpret_cast<const float4*>(stripe + r * kLdO + c);
    const float4 hi = *reinterpret_cast<const float4*>(stripe + r * kLdO + c + 4);
    alignas(16) T packed[8];
    to2(lo.x * factor, lo.y * factor, packed);
    to2(lo.z * factor, lo.w * factor, packed + 2);
    to2(hi.x * factor, hi.y * factor, packed + 4);
    to2(hi.z * factor, hi.w * factor, packed + 6);
    *reinterpret_cast<uint4*>(dst + (i0 + r) * row_stride + c) = *reinterpret_cast<const uint4*>(packed);
  }
}

// (16 x kD) = A (16 x kNP, k-tiles `a_step` apart) @ B (kNP x kD, a row-major tile), stored to `out` (stride kLdO).
template <typename T, typename FragLeft>
__device__ void stripe_times_tile(const T* a, int a_step, int lda, const T* b, float* out) {
  FragC acc[kD / 16];
#pragma unroll
  for (int c = 0; c < kD / 16; ++c) wmma::fill_fragment(acc[c], 0.f);
#pragma unroll
  for (int k = 0; k < kNP / 16; ++k) {
    FragLeft left;
    wmma::load_matrix_sync(left, a + k * a_step, lda);
#pragma unroll
    for (int c = 0; c < kD / 16; ++c) {
      FragB<T> right;
      wmma::load_matrix_sync(right, b + 16 * k * kLdX + 16 * c, kLdX);
      wmma::mma_sync(acc[c], left, right, acc[c]);
    }
  }
#pragma unroll
  for (int c = 0; c < kD / 16; ++c) wmma::store_matrix_sync(out + 16 * c, acc[c], kLdO, wmma::mem_row_major);
}

// (16 x kNP) = rows [16w, 16w + 16) of x (kNP x kD) @ y^T, stored to `out` (stride kLdS).
template <typename T>
__device__ void stripe_scores(const T* x, const T* y, int warp, float* out) {
  FragA<T> left[kD / 16];
#pragma unroll
  for (int k = 0; k < kD / 16; ++k) wmma::load_matrix_sync(left[k], x + 16 * warp * kLdX + 16 * k, kLdX);
#pragma unroll
  for (int c = 0; c < kNP / 16; ++c) {
    FragC acc;
    wmma::fill_fragment(acc, 0.f);
#pragma unroll
    for (int k = 0; k < kD / 16; ++k) {
      FragBt<T> right;  // y^T: element (k, j) is y[j][k]
      wmma::load_matrix_sync(right, y + 16 * c * kLdX + 16 * k, kLdX);
      wmma::mma_sync(acc, left[k], right, acc);
    }
    wmma::store_matrix_sync(out + 16 * c, acc, kLdS, wmma::mem_row_major);
  }
}

// The block's additive term for every logit: head h's bias plus the shift mask of window position w (a block's
// windows all share one position: the grid's stride over windows is a multiple of the mask's nW); -inf outside
// the window, so padded columns get probability 0.
__device__ void load_bias_mask(float* tile, const float* bias, const float* mask, int h, int w, int N) {
  for (int e = threadIdx.x; e < kNP * kNP; e += kThreads) {
    const int i = e / kNP, j = e % kNP;
    tile[i * kLdS + j] =
        i < N && j < N ? bias[(h * N + i) * N + j] + (mask ? mask[(w * N + i) * N + j] : 0.f) : -INFINITY;
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads, 4) window_attention_forward_kernel(
    const T* __restrict__ qkv, T* __restrict__ out, float* __restrict__ lse, const float* __restrict__ bias_in,
    const float* __restrict__ mask, int64_t windows, int n_mask, int heads, int N, float scale) {
  extern __shared__ __align__(128) unsigned char smem[];
  const Layout layout = forward_layout(N);
  const int tile = Layout::tile_bytes() / sizeof(T);
  T* q = reinterpret_cast<T*>(smem);
  T* k = q + tile;
  T* v = k + tile;
  float* bias = reinterpret_cast<float*>(smem + layout.bias_offset());
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, h = blockIdx.y;
  float* scores = reinterpret_cast<float*>(smem + layout.scratch_offset() + warp * kForwardStripe);
  T* probs = reinterpret_cast<T*>(scores);  // P takes the scores' place once they are all in registers
  float* o = reinterpret_cast<float*>(smem + layout.scratch_offset() + warp * kForwardStripe + 16 * kLdP * 2);
  const int C = heads * kD, r = lane / 2, i = 16 * warp + r;
  load_bias_mask(bias, bias_in, mask, h, blockIdx.x % n_mask, N);
  Staged<3> next;
  int64_t b = blockIdx.x;
  if (b < windows) next.fetch(qkv + b * N * 3 * C + h * kD, C, 3 * C, N);
  for (; b < windows; b += gridDim.x) {
    next.store(q, tile);
    __syncthreads();
    if (b + gridDim.x < windows) next.fetch(qkv + (b + gridDim.x) * N * 3 * C + h * kD, C, 3 * C, N);
    stripe_scores(q, k, warp, scores);
    __syncwarp();
    float x[2 * kPairs];
    float top = -INFINITY;
#pragma unroll
    for (int p = 0; p < kPairs; ++p) {
      const int j = pair_column(p, lane);
      const float2 s2 = *reinterpret_cast<const float2*>(scores + r * kLdS + j);
      const float2 b2 = *reinterpret_cast<const float2*>(bias + i * kLdS + j);
      x[2 * p] = s2.x * scale + b2.x;
      x[2 * p + 1] = s2.y * scale + b2.y;
      top = fmaxf(top, fmaxf(x[2 * p], x[2 * p + 1]));
    }
    top = fmaxf(top, __shfl_xor_sync(0xffffffff, top, 1));
    float total = 0.f;
#pragma unroll
    for (int e = 0; e < 2 * kPairs; ++e) {
      x[e] = i < N ? __expf(x[e] - top) : 0.f;
      total += x[e];
    }
    total += __shfl_xor_sync(0xffffffff, total, 1);
    const float inv = i < N ? 1.f / total : 0.f;
    __syncwarp();  // all scores are in registers: P may overwrite them
#pragma unroll
    for (int p = 0; p < kPairs; ++p) to2(x[2 * p] * inv, x[2 * p + 1] * inv, probs + r * kLdP + pair_column(p, lane));
    if ((lane & 1) == 0 && i < N) lse[(b * heads + h) * N + i] = top + __logf(total);
    __syncwarp();
    stripe_times_tile<T, FragA<T>>(probs, 16, kLdP, v, o);
    __syncwarp();
    store_stripe(o, out + b * N * C + h * kD, C, 16 * warp, N, 1.f);
    __syncthreads();  // q, k, v take the next window
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads, 3) window_attention_backward_kernel(
    const T* __restrict__ grad_out, const T* __restrict__ qkv, const float* __restrict__ lse, T* __restrict__ grad_qkv,
    float* __restrict__ grad_bias, const float* __restrict__ bias_in, const float* __restrict__ mask,
    int64_t windows, int n_mask, int heads, int N, float scale) {
  extern __shared__ __align__(128) unsigned char smem[];
  const Layout layout = backward_layout(N);
  const int tile = Layout::tile_bytes() / sizeof(T);
  T* q = reinterpret_cast<T*>(smem);
  T* k = q + tile;
  T* v = k + tile;
  T* dout = v + tile;
  T* probs = reinterpret_cast<T*>(smem + layout.full_offset());
  T* dscores = probs + Layout::full_bytes() / sizeof(T);
  float* bias = reinterpret_cast<float*>(smem + layout.bias_offset());
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, h = blockIdx.y;
  float* scratch = reinterpret_cast<float*>(smem + layout.scratch_offset() + warp * kScoreStripe);
  const int C = heads * kD, r = lane / 2, i = 16 * warp + r;
  load_bias_mask(bias, bias_in, mask, h, blockIdx.x % n_mask, N);
  float bias_grad[2 * kPairs] = {};
  Staged<3> next;
  Staged<1> next_grad;
  int64_t b = blockIdx.x;
  if (b < windows) {
    next.fetch(qkv + b * N * 3 * C + h * kD, C, 3 * C, N);
    next_grad.fetch(grad_out + b * N * C + h * kD, 0, C, N);
  }
  for (; b < windows; b += gridDim.x) {
    next.store(q, tile);
    next_grad.store(dout, tile);
    __syncthreads();
    if (b + gridDim.x < windows) {
      next.fetch(qkv + (b + gridDim.x) * N * 3 * C + h * kD, C, 3 * C, N);
      next_grad.fetch(grad_out + (b + gridDim.x) * N * C + h * kD, 0, C, N);
    }
    // P, recomputed from the saved log-sum-exp, stays in registers while dP takes the scratch stripe.
    stripe_scores(q, k, warp, scratch);
    __syncwarp();
    const float row_lse = i < N ? lse[(b * heads + h) * N + i] : INFINITY;
    float p[2 * kPairs];
#pragma unroll
    for (int c = 0; c < kPairs; ++c) {
      const int j = pair_column(c, lane);
      const float2 s2 = *reinterpret_cast<const float2*>(scratch + r * kLdS + j);
      const float2 b2 = *reinterpret_cast<const float2*>(bias + i * kLdS + j);
      p[2 * c] = __expf(s2.x * scale + b2.x - row_lse);
      p[2 * c + 1] = __expf(s2.y * scale + b2.y - row_lse);
    }
    __syncwarp();
    stripe_scores(dout, v, warp, scratch);  // dP = dO V^T
    __syncwarp();
    float dot = 0.f;
#pragma unroll
    for (int c = 0; c < kPairs; ++c) {
      const float2 dp = *reinterpret_cast<const float2*>(scratch + r * kLdS + pair_column(c, lane));
      dot += p[2 * c] * dp.x + p[2 * c + 1] * dp.y;
    }
    dot += __shfl_xor_sync(0xffffffff, dot, 1);
#pragma unroll
    for (int c = 0; c < kPairs; ++c) {
      const int j = pair_column(c, lane);
      const float2 dp = *reinterpret_cast<const float2*>(scratch + r * kLdS + j);  // re-read: fewer registers
      const float ds0 = p[2 * c] * (dp.x - dot), ds1 = p[2 * c + 1] * (dp.y - dot);
      bias_grad[2 * c] += ds0;
      bias_grad[2 * c + 1] += ds1;
      to2(p[2 * c], p[2 * c + 1], probs + i * kLdP + j);
      to2(ds0, ds1, dscores + i * kLdP + j);
    }
    __syncwarp();
    // dQ = dS K * scale, this warp's rows.
    stripe_times_tile<T, FragA<T>>(dscores + 16 * warp * kLdP, 16, kLdP, k, scratch);
    __syncwarp();
    store_stripe(scratch, grad_qkv + b * N * 3 * C + h * kD, 3 * C, 16 * warp, N, scale);
    __syncthreads();  // every warp's rows of P and dS are in
    // dV = P^T dO and dK = dS^T Q * scale, this warp's rows j: column stripes of P and dS, read transposed.
    stripe_times_tile<T, FragAt<T>>(probs + 16 * warp, 16 * kLdP, kLdP, dout, scratch);
    __syncwarp();
    store_stripe(scratch, grad_qkv + b * N * 3 * C + 2 * C + h * kD, 3 * C, 16 * warp, N, 1.f);
    __syncwarp();
    stripe_times_tile<T, FragAt<T>>(dscores + 16 * warp, 16 * kLdP, kLdP, q, scratch);
    __syncwarp();
    store_stripe(scratch, grad_qkv + b * N * 3 * C + C + h * kD, 3 * C, 16 * warp, N, scale);
    __syncthreads();  // the tiles take the next window
  }
  if (i >= N) return;
#pragma unroll
  for (int c = 0; c < kPairs; ++c) {
    const int j = pair_column(c, lane);
    if (j < N) atomicAdd(grad_bias + (h * N + i) * N + j, bias_grad[2 * c]);
    if (j + 1 < N) atomicAdd(grad_bias + (h * N + i) * N + j + 1, bias_grad[2 * c + 1]);
  }
}

struct Launch {
  dim3 grid;
  int smem;
};

// One block per (window chunk, head), as many as fit on the GPU at once: every block gets the same number of windows,
// so one wave has no tail, and each block pays its bias load and the backward's atomic adds once for many windows.
// The chunk count is a multiple of the mask's nW so that every window a block walks sits at the same mask position.
template <typename Kernel>
Launch plan(Kernel kernel, const Layout& layout, int64_t windows, int heads, int n_mask) {
  static const bool opted_in = [&] {  // the widest layout (N = kNP) needs more than the default 48 KiB
    Layout widest = layout;
    widest.N = kNP;
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, widest.bytes()));
    return true;
  }();
  (void)opted_in;
  int per_sm = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, layout.bytes()));
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t target = std::max(per_sm, 1) * sms;
  const int64_t wanted = std::min<int64_t>((windows + 3) / 4, target / heads);
  const int64_t chunks = std::max<int64_t>(1, wanted / n_mask) * n_mask;  // windows is a multiple of n_mask
  return {dim3(static_cast<unsigned>(chunks), static_cast<unsigned>(heads)), layout.bytes()};
}

void check_inputs(const torch::Tensor& qkv, const torch::Tensor& bias, const c10::optional<torch::Tensor>& mask) {
  TORCH_CHECK(qkv.is_cuda() && qkv.dim() == 3 && qkv.is_contiguous(), "qkv must be a contiguous CUDA (B_, N, 3C)");
  TORCH_CHECK(qkv.scalar_type() == at::kHalf || qkv.scalar_type() == at::kBFloat16, "qkv must be half or bfloat16");
  const int64_t N = qkv.size(1), heads = bias.size(0);
  TORCH_CHECK(N <= kNP && qkv.size(2) == 3 * heads * kD, "fused window attention takes N <= ", kNP,
              " and head dim ", kD, ", got ", qkv.sizes(), " with ", heads, " heads");
  TORCH_CHECK(bias.dim() == 3 && bias.size(1) == N && bias.size(2) == N && bias.scalar_type() == at::kFloat &&
                  bias.is_contiguous(),
              "bias must be contiguous float (heads, N, N), got ", bias.sizes());
  if (mask) {
    TORCH_CHECK(mask->dim() == 3 && mask->size(1) == N && mask->size(2) == N && mask->scalar_type() == at::kFloat &&
                    mask->is_contiguous() && qkv.size(0) % mask->size(0) == 0,
                "shift mask must be contiguous float (nW, N, N), got ", mask->sizes());
  }
}

template <typename Run>
void dispatch(const torch::Tensor& qkv, Run run) {
  if (qkv.scalar_type() == at::kHalf) run(static_cast<__half*>(nullptr));
  else run(static_cast<__nv_bfloat16*>(nullptr));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

std::vector<torch::Tensor> window_attention_forward_cuda(const torch::Tensor& qkv, const torch::Tensor& bias,
                                                         const c10::optional<torch::Tensor>& mask, double scale) {
  check_inputs(qkv, bias, mask);
  c10::cuda::CUDAGuard guard(qkv.device());
  const int64_t windows = qkv.size(0), N = qkv.size(1), heads = bias.size(0);
  auto out = torch::empty({windows, N, heads * kD}, qkv.options());
  auto lse = torch::empty({windows, heads, N}, qkv.options().dtype(torch::kFloat));
  if (windows == 0) return {out, lse};
  const Layout layout = forward_layout(static_cast<int>(N));
  dispatch(qkv, [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    auto kernel = window_attention_forward_kernel<T>;
    const Launch launch = plan(kernel, layout, windows, heads, mask ? mask->size(0) : 1);
    kernel<<<launch.grid, kThreads, launch.smem, at::cuda::getCurrentCUDAStream()>>>(
        reinterpret_cast<const T*>(qkv.data_ptr()), reinterpret_cast<T*>(out.data_ptr()), lse.data_ptr<float>(),
        bias.data_ptr<float>(), mask ? mask->data_ptr<float>() : nullptr, windows, mask ? mask->size(0) : 1, heads,
        N, static_cast<float>(scale));
  });
  return {out, lse};
}

std::vector<torch::Tensor> window_attention_backward_cuda(const torch::Tensor& grad_out, const torch::Tensor& qkv,
                                                          const torch::Tensor& lse, const torch::Tensor& bias,
                                                          const c10::optional<torch::Tensor>& mask, double scale) {
  check_inputs(qkv, bias, mask);
  c10::cuda::CUDAGuard guard(qkv.device());
  const int64_t windows = qkv.size(0), N = qkv.size(1), heads = bias.size(0);
  TORCH_CHECK(grad_out.sizes() == torch::IntArrayRef({windows, N, heads * kD}) && grad_out.is_contiguous() &&
                  grad_out.scalar_type() == qkv.scalar_type(),
              "output gradient must be contiguous (", windows, ", ", N, ", ", heads * kD, ") in qkv's dtype");
  TORCH_CHECK(lse.sizes() == torch::IntArrayRef({windows, heads, N}) && lse.is_contiguous(), "bad log-sum-exp");
  auto grad_qkv = torch::empty_like(qkv);
  auto grad_bias = torch::zeros({heads, N, N}, qkv.options().dtype(torch::kFloat));
  if (windows == 0) return {grad_qkv, grad_bias};
  const Layout layout = backward_layout(static_cast<int>(N));
  dispatch(qkv, [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    auto kernel = window_attention_backward_kernel<T>;
    const Launch launch = plan(kernel, layout, windows, heads, mask ? mask->size(0) : 1);
    kernel<<<launch.grid, kThreads, launch.smem, at::cuda::getCurrentCUDAStream()>>>(
        reinterpret_cast<const T*>(grad_out.data_ptr()), reinterpret_cast<const T*>(qkv.data_ptr()),
        lse.data_ptr<float>(), reinterpret_cast<T*>(grad_qkv.data_ptr()), grad_bias.data_ptr<float>(),
        bias.data_ptr<float>(), mask ? mask->data_ptr<float>() : nullptr, windows, mask ? mask->size(0) : 1, heads,
        N, static_cast<float>(scale));
  });
  return {grad_qkv, grad_bias};
}
