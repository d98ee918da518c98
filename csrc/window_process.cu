// Cyclic shift + window partition, and window merge + reverse shift, as one kernel each.
// Both directions are the same bijection between (b, h, w) in the feature map and (window, token) in the windows;
// partition gathers rows of C channels from the map into windows, merge scatters them back (a gather the other way).
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

namespace {

// Threads of a block row (threadIdx.x) move the 16-byte vectors of one map position; block rows (threadIdx.y) and
// the grid stride walk positions, so index arithmetic is done once per position, in 32 bits.
template <typename vec_t, bool kMerge>
__global__ void window_process_kernel(const vec_t* __restrict__ src, vec_t* __restrict__ dst, int rows, int H,
                                      int W, int window, int shift, int vecs_per_row) {
  const int n_wh = H / window, n_ww = W / window;
  for (int row = blockIdx.x * blockDim.y + threadIdx.y; row < rows; row += gridDim.x * blockDim.y) {
    const int w = row % W, hb = row / W;
    const int h = hb % H, b = hb / H;
    // The map position (h, w) lands at (h - shift, w - shift) after the cyclic shift by -shift.
    const int hs = h >= shift ? h - shift : h - shift + H;
    const int ws = w >= shift ? w - shift : w - shift + W;
    const int window_row = ((b * n_wh + hs / window) * n_ww + ws / window) * window * window +
                           (hs % window) * window + (ws % window);
    const int64_t map_offset = (int64_t)row * vecs_per_row, window_offset = (int64_t)window_row * vecs_per_row;
    for (int v = threadIdx.x; v < vecs_per_row; v += blockDim.x) {
      if (kMerge) {
        dst[map_offset + v] = src[window_offset + v];
      } else {
        dst[window_offset + v] = src[map_offset + v];
      }
    }
  }
}

template <typename vec_t, bool kMerge>
void launch_typed(const void* src, void* dst, int64_t rows, int H, int W, int window, int shift, int vecs) {
  const int x = vecs >= 32 ? 32 : (vecs >= 16 ? 16 : (vecs >= 8 ? 8 : (vecs >= 4 ? 4 : (vecs >= 2 ? 2 : 1))));
  const dim3 threads(x, 256 / x);
  const int64_t max_blocks = at::cuda::getCurrentDeviceProperties()->multiProcessorCount * 16;
  const int blocks = (int)std::min<int64_t>((rows + threads.y - 1) / threads.y, max_blocks);
  window_process_kernel<vec_t, kMerge><<<blocks, threads, 0, at::cuda::getCurrentCUDAStream()>>>(
      static_cast<const vec_t*>(src), static_cast<vec_t*>(dst), (int)rows, H, W, window, shift, vecs);
}

template <bool kMerge>
void launch(const torch::Tensor& src, torch::Tensor& dst, int64_t rows, int H, int W, int window, int shift,
            int64_t C) {
  TORCH_CHECK(rows < INT_MAX, "window process: ", rows, " positions is more than 2^31");
  const int64_t bytes = C * src.element_size();
  const bool aligned = bytes % 16 == 0 && reinterpret_cast<uintptr_t>(src.data_ptr()) % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(dst.data_ptr()) % 16 == 0;
  if (aligned) {
    launch_typed<int4, kMerge>(src.data_ptr(), dst.data_ptr(), rows, H, W, window, shift, (int)(bytes / 16));
  } else {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, src.scalar_type(), "window_process", [&] {
      launch_typed<scalar_t, kMerge>(src.data_ptr(), dst.data_ptr(), rows, H, W, window, shift, (int)C);
    });
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void check_map(int64_t H, int64_t W, int64_t window, int64_t shift) {
  TORCH_CHECK(window > 0, "window must be positive, got ", window);
  TORCH_CHECK(H % window == 0 && W % window == 0, "feature map ", H, "x", W, " is not a multiple of window ",
              window, " (pad it, or pick a window that divides it)");
  TORCH_CHECK(shift >= 0 && shift < window, "shift must be in [0, window), got ", shift, " for window ", window);
}

}  // namespace

torch::Tensor window_partition_cuda(const torch::Tensor& x, int64_t window, int64_t shift) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 4, "window_partition expects a CUDA tensor (B, H, W, C), got ", x.sizes());
  const int64_t B = x.size(0), H = x.size(1), W = x.size(2), C = x.size(3);
  check_map(H, W, window, shift);
  c10::cuda::CUDAGuard guard(x.device());
  auto src = x.contiguous();
  auto out = torch::empty({B * (H / window) * (W / window), window * window, C}, x.options());
  if (out.numel()) launch<false>(src, out, B * H * W, H, W, window, shift, C);
  return out;
}

torch::Tensor window_merge_cuda(const torch::Tensor& windows, int64_t window, int64_t shift, int64_t H, int64_t W) {
  TORCH_CHECK(windows.is_cuda() && windows.dim() == 3, "window_merge expects a CUDA tensor (B*nW, N, C), got ",
              windows.sizes());
  check_map(H, W, window, shift);
  const int64_t n_windows = (H / window) * (W / window), C = windows.size(2);
  TORCH_CHECK(windows.size(1) == window * window, "window_merge: ", windows.size(1), " tokens per window, expected ",
              window * window);
  TORCH_CHECK(windows.size(0) % n_windows == 0, "window_merge: ", windows.size(0), " windows is not a multiple of ",
              n_windows, " per image");
  c10::cuda::CUDAGuard guard(windows.device());
  auto src = windows.contiguous();
  const int64_t B = windows.size(0) / n_windows;
  auto out = torch::empty({B, H, W, C}, windows.options());
  if (out.numel()) launch<true>(src, out, B * H * W, H, W, window, shift, C);
  return out;
}
