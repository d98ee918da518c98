// Linear -> GELU -> Linear on cuBLASLt, forward and backward. fc1's bias and GELU run in its matmul's epilogue, which
// also writes the GELU input; the backward's first matmul applies GELU's derivative in its epilogue (DGELU), so no
// separate pass reads the (rows, hidden) activations either way. Each matmul takes the fastest of the heuristic's
// candidate algorithms for its shape, timed on first use: the heuristic's first pick was up to 22% slower for these
// shapes on an H200 (docs/performance.md). cuBLASLt's GELU is the tanh form (trainer/ops/cuda.py says what that
// changes).
#include <ATen/cuda/CUDAContext.h>
#include <cublasLt.h>
#include <torch/extension.h>

#include <c10/cuda/CUDAException.h>

#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>

namespace {

constexpr int64_t kWorkspaceBytes = 32 << 20;  // what cuBLASLt's heuristics want on Hopper
constexpr int kCandidates = 8;
constexpr uint32_t kAlignment = 16;  // what trainer/ops/cuda.py's aligned() guarantees, so a cached algorithm fits

void check_lt(cublasStatus_t status, const char* what) {
  TORCH_CHECK(status == CUBLAS_STATUS_SUCCESS, "cuBLASLt ", what, ": ", cublasLtGetStatusString(status));
}

struct DescDeleter {
  void operator()(cublasLtMatmulDescOpaque_t* d) const { cublasLtMatmulDescDestroy(d); }
  void operator()(cublasLtMatrixLayoutOpaque_t* l) const { cublasLtMatrixLayoutDestroy(l); }
  void operator()(cublasLtMatmulPreferenceOpaque_t* p) const { cublasLtMatmulPreferenceDestroy(p); }
};
using MatmulDesc = std::unique_ptr<cublasLtMatmulDescOpaque_t, DescDeleter>;
using Layout = std::unique_ptr<cublasLtMatrixLayoutOpaque_t, DescDeleter>;
using Preference = std::unique_ptr<cublasLtMatmulPreferenceOpaque_t, DescDeleter>;

Layout layout(cudaDataType_t type, int64_t rows, int64_t cols, int64_t ld) {
  cublasLtMatrixLayout_t raw;
  check_lt(cublasLtMatrixLayoutCreate(&raw, type, rows, cols, ld), "layout");
  return Layout(raw);
}

template <typename T>
void set(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attribute, const T& value) {
  check_lt(cublasLtMatmulDescSetAttribute(desc, attribute, &value, sizeof(value)), "matmul attribute");
}

// The candidate that ran fastest, 3 runs each after a warm-up, on the current stream.
template <typename Run>
cublasLtMatmulAlgo_t fastest(const cublasLtMatmulHeuristicResult_t* candidates, int found, cudaStream_t stream,
                             const Run& run) {
  cudaEvent_t start, stop;
  C10_CUDA_CHECK(cudaEventCreate(&start));
  C10_CUDA_CHECK(cudaEventCreate(&stop));
  cublasLtMatmulAlgo_t best = candidates[0].algo;
  float best_ms = std::numeric_limits<float>::infinity();
  for (int i = 0; i < found; ++i) {
    if (run(candidates[i].algo) != CUBLAS_STATUS_SUCCESS) continue;  // also the warm-up
    C10_CUDA_CHECK(cudaEventRecord(start, stream));
    for (int repeat = 0; repeat < 3; ++repeat) check_lt(run(candidates[i].algo), "matmul");
    C10_CUDA_CHECK(cudaEventRecord(stop, stream));
    C10_CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    C10_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    if (ms < best_ms) {
      best_ms = ms;
      best = candidates[i].algo;
    }
  }
  C10_CUDA_CHECK(cudaEventDestroy(start));
  C10_CUDA_CHECK(cudaEventDestroy(stop));
  return best;
}

// device, data type, m, n, k, transpose a, transpose b, epilogue, torch.use_deterministic_algorithms
using AlgoKey = std::tuple<int, int, int64_t, int64_t, int64_t, bool, bool, int, bool>;

// One matmul shape's algorithm, chosen once per process: the fastest of the heuristic's candidates, or under
// torch.use_deterministic_algorithms (the timed choice varies between runs) the heuristic's first pick. While a CUDA
// graph is captured, where nothing can be timed, that first pick is used but not kept, so a later call times.
template <typename Run>
cublasLtMatmulAlgo_t choose_algo(const AlgoKey& key, cublasLtMatmulDesc_t desc, cublasLtMatrixLayout_t la,
                                 cublasLtMatrixLayout_t lb, cublasLtMatrixLayout_t ld, cudaStream_t stream,
                                 const Run& run) {
  static std::mutex mutex;
  static std::map<AlgoKey, cublasLtMatmulAlgo_t> chosen;
  {
    std::lock_guard<std::mutex> lock(mutex);
    if (auto it = chosen.find(key); it != chosen.end()) return it->second;
  }
  cublasLtMatmulPreference_t raw_preference;
  check_lt(cublasLtMatmulPreferenceCreate(&raw_preference), "preference");
  Preference preference(raw_preference);
  auto prefer = [&](cublasLtMatmulPreferenceAttributes_t attribute, const auto& value) {
    check_lt(cublasLtMatmulPreferenceSetAttribute(raw_preference, attribute, &value, sizeof(value)), "preference");
  };
  prefer(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, static_cast<uint64_t>(kWorkspaceBytes));
  for (auto attribute : {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                         CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES}) {
    prefer(attribute, kAlignment);
  }
  cublasLtMatmulHeuristicResult_t candidates[kCandidates];
  int found = 0;
  check_lt(cublasLtMatmulAlgoGetHeuristic(at::cuda::getCurrentCUDABlasLtHandle(), desc, la, lb, ld, ld,
                                          raw_preference, kCandidates, candidates, &found),
           "heuristic");
  TORCH_CHECK(found > 0, "cuBLASLt has no kernel for the fused MLP's ", std::get<2>(key), "x", std::get<3>(key), "x",
              std::get<4>(key), " matmul; run with --fused all,mlp=reference");
  cudaStreamCaptureStatus capture;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  if (capture != cudaStreamCaptureStatusNone) return candidates[0].algo;
  cublasLtMatmulAlgo_t best = candidates[0].algo;
  if (found > 1 && !std::get<8>(key)) best = fastest(candidates, found, stream, run);
  std::lock_guard<std::mutex> lock(mutex);
  return chosen.emplace(key, best).first->second;
}

// Column-major d (m, n) = epilogue(op(a) @ op(b)): a stored (k, m) when transpose_a, else (m, k); b stored (n, k)
// when transpose_b, else (k, n). `aux` is the GELU input: written by GELU_AUX_BIAS, read by DGELU.
void lt_matmul(const at::Tensor& a, bool transpose_a, const at::Tensor& b, bool transpose_b, at::Tensor& d, int64_t m,
               int64_t n, int64_t k, cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_DEFAULT,
               const at::Tensor* bias = nullptr, const at::Tensor* aux = nullptr) {
  const cudaDataType_t type = b.scalar_type() == at::kHalf ? CUDA_R_16F : CUDA_R_16BF;
  cublasLtMatmulDesc_t raw_desc;
  check_lt(cublasLtMatmulDescCreate(&raw_desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), "matmul descriptor");
  MatmulDesc desc(raw_desc);
  set(raw_desc, CUBLASLT_MATMUL_DESC_TRANSA, transpose_a ? CUBLAS_OP_T : CUBLAS_OP_N);
  set(raw_desc, CUBLASLT_MATMUL_DESC_TRANSB, transpose_b ? CUBLAS_OP_T : CUBLAS_OP_N);
  set(raw_desc, CUBLASLT_MATMUL_DESC_EPILOGUE, epilogue);
  if (bias != nullptr) set(raw_desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, bias->data_ptr());
  if (aux != nullptr) {
    set(raw_desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, aux->data_ptr());
    set(raw_desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, m);
  }
  Layout la = transpose_a ? layout(type, k, m, k) : layout(type, m, k, m);
  Layout lb = transpose_b ? layout(type, n, k, n) : layout(type, k, n, k);
  Layout ld = layout(type, m, n, m);
  auto workspace = at::empty({kWorkspaceBytes}, b.options().dtype(at::kByte));
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const float alpha = 1.0f, beta = 0.0f;
  auto run = [&](const cublasLtMatmulAlgo_t& algo) {
    return cublasLtMatmul(at::cuda::getCurrentCUDABlasLtHandle(), raw_desc, &alpha, a.data_ptr(), la.get(),
                          b.data_ptr(), lb.get(), &beta, d.data_ptr(), ld.get(), d.data_ptr(), ld.get(), &algo,
                          workspace.data_ptr(), kWorkspaceBytes, stream);
  };
  const AlgoKey key{d.get_device(), type, m, n, k, transpose_a, transpose_b, epilogue,
                    at::globalContext().deterministicAlgorithms()};
  check_lt(run(choose_algo(key, raw_desc, la.get(), lb.get(), ld.get(), stream, run)), "matmul");
}

void check_inputs(std::initializer_list<const at::Tensor*> tensors) {
  const auto dtype = (*tensors.begin())->scalar_type();
  for (const at::Tensor* t : tensors) {
    TORCH_CHECK(t->is_cuda() && t->is_contiguous() && t->scalar_type() == dtype, "fused MLP expects contiguous CUDA ",
                "tensors of one dtype");
    TORCH_CHECK(t->size(-1) % 8 == 0 && reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 == 0,
                "fused MLP needs 16-byte aligned rows (feature sizes a multiple of 8)");
  }
  TORCH_CHECK(dtype == at::kHalf || dtype == at::kBFloat16, "fused MLP takes half or bfloat16");
}

}  // namespace

// cuBLASLt is column-major, where a row-major (r, c) tensor reads as its (c, r) transpose: each call below computes the
// transpose of its row-major product, e.g. act^T = GELU(w1 x^T + b1).

// x (M, K), w1 (H, K), b1 (H), w2 (N, H), b2 (N) -> y (M, N), GELU input and output (M, H), kept for backward.
std::vector<at::Tensor> fused_mlp_forward_cuda(const at::Tensor& x, const at::Tensor& w1, const at::Tensor& b1,
                                               const at::Tensor& w2, const at::Tensor& b2) {
  check_inputs({&x, &w1, &b1, &w2, &b2});
  const int64_t rows = x.size(0), dim = x.size(1), hidden = w1.size(0), out = w2.size(0);
  auto pre = at::empty({rows, hidden}, x.options());
  auto act = at::empty({rows, hidden}, x.options());
  auto y = at::empty({rows, out}, x.options());
  lt_matmul(w1, true, x, false, act, hidden, rows, dim, CUBLASLT_EPILOGUE_GELU_AUX_BIAS, &b1, &pre);
  lt_matmul(w2, true, act, false, y, out, rows, hidden, CUBLASLT_EPILOGUE_BIAS, &b2);
  return {y, pre, act};
}

// grad of y (M, N) and what the forward kept -> gradients of the GELU input (for fc1's bias), x, w1 and w2.
std::vector<at::Tensor> fused_mlp_backward_cuda(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& pre,
                                                const at::Tensor& act, const at::Tensor& w1, const at::Tensor& w2) {
  check_inputs({&grad, &x, &pre, &act, &w1, &w2});
  const int64_t rows = x.size(0), dim = x.size(1), hidden = w1.size(0), out = w2.size(0);
  auto grad_pre = at::empty({rows, hidden}, x.options());
  auto grad_x = at::empty({rows, dim}, x.options());
  auto grad_w1 = at::empty({hidden, dim}, x.options());
  auto grad_w2 = at::empty({out, hidden}, x.options());
  lt_matmul(w2, false, grad, false, grad_pre, hidden, rows, out, CUBLASLT_EPILOGUE_DGELU, nullptr, &pre);
  lt_matmul(w1, false, grad_pre, false, grad_x, dim, rows, hidden);
  lt_matmul(x, false, grad_pre, true, grad_w1, dim, hidden, rows);
  lt_matmul(act, false, grad, true, grad_w2, hidden, out, rows);
  return {grad_pre, grad_x, grad_w1, grad_w2};
}
