// Linear -> GELU -> Linear, forward: fc1's bias and GELU run in the epilogue of its cuBLASLt matmul, which also writes
// the GELU input for backward, so no separate GELU pass reads the (rows, hidden) activations. The backward is plain
// torch ops in trainer/ops/cuda.py, where Inductor fuses them (cuBLASLt's DGELU_BGRAD epilogue ran as a separate,
// slower kernel). cuBLASLt's GELU is the tanh form (trainer/ops/cuda.py says what that changes).
#include <ATen/cuda/CUDAContext.h>
#include <cublasLt.h>
#include <torch/extension.h>

#include <memory>

namespace {

constexpr int64_t kWorkspaceBytes = 32 << 20;  // what cuBLASLt's heuristics want on Hopper

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

// act = GELU(w @ x^T + bias) column-major, i.e. row-major act = GELU(x w^T + bias), with its input written to `pre`.
void gelu_aux_bias_gemm(const at::Tensor& w, const at::Tensor& x, const at::Tensor& bias, at::Tensor& act,
                        at::Tensor& pre) {
  const int64_t m = w.size(0), n = x.size(0), k = x.size(1);
  const cudaDataType_t type = x.scalar_type() == at::kHalf ? CUDA_R_16F : CUDA_R_16BF;
  cublasLtMatmulDesc_t raw_desc;
  check_lt(cublasLtMatmulDescCreate(&raw_desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), "matmul descriptor");
  MatmulDesc desc(raw_desc);
  set(raw_desc, CUBLASLT_MATMUL_DESC_TRANSA, CUBLAS_OP_T);
  set(raw_desc, CUBLASLT_MATMUL_DESC_TRANSB, CUBLAS_OP_N);
  set(raw_desc, CUBLASLT_MATMUL_DESC_EPILOGUE, CUBLASLT_EPILOGUE_GELU_AUX_BIAS);
  set(raw_desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, bias.data_ptr());
  set(raw_desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, pre.data_ptr());
  set(raw_desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, m);
  Layout a = layout(type, k, m, k), b = layout(type, k, n, k), d = layout(type, m, n, m);
  cublasLtMatmulPreference_t raw_preference;
  check_lt(cublasLtMatmulPreferenceCreate(&raw_preference), "preference");
  Preference preference(raw_preference);
  check_lt(cublasLtMatmulPreferenceSetAttribute(raw_preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                &kWorkspaceBytes, sizeof(kWorkspaceBytes)),
           "workspace preference");
  cublasLtHandle_t handle = at::cuda::getCurrentCUDABlasLtHandle();
  cublasLtMatmulHeuristicResult_t heuristic;
  int found = 0;
  check_lt(cublasLtMatmulAlgoGetHeuristic(handle, raw_desc, a.get(), b.get(), d.get(), d.get(), raw_preference, 1,
                                          &heuristic, &found),
           "heuristic");
  TORCH_CHECK(found > 0, "cuBLASLt has no GELU_AUX_BIAS kernel for a ", m, "x", n, "x", k,
              " matmul; run with --fused all,mlp=reference");
  auto workspace = at::empty({kWorkspaceBytes}, x.options().dtype(at::kByte));
  const float alpha = 1.0f, beta = 0.0f;
  check_lt(cublasLtMatmul(handle, raw_desc, &alpha, w.data_ptr(), a.get(), x.data_ptr(), b.get(), &beta,
                          act.data_ptr(), d.get(), act.data_ptr(), d.get(), &heuristic.algo, workspace.data_ptr(),
                          kWorkspaceBytes, at::cuda::getCurrentCUDAStream()),
           "matmul");
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

// x (M, K), w1 (H, K), b1 (H), w2 (N, H), b2 (N) -> y (M, N), GELU input (M, H).
std::vector<at::Tensor> fused_mlp_forward_cuda(const at::Tensor& x, const at::Tensor& w1, const at::Tensor& b1,
                                               const at::Tensor& w2, const at::Tensor& b2) {
  check_inputs({&x, &w1, &b1, &w2, &b2});
  const int64_t rows = x.size(0), hidden = w1.size(0);
  auto pre = at::empty({rows, hidden}, x.options());
  auto act = at::empty({rows, hidden}, x.options());
  // Row-major (rows, hidden) act is column-major (hidden, rows) = w1 (column-major (K, H), transposed) @ x (K, rows).
  gelu_aux_bias_gemm(w1, x, b1, act, pre);
  return {at::addmm(b2, act, w2.t()), pre};
}
