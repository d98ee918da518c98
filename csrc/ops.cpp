// Python bindings of the CUDA kernels; torch.library registration, fake implementations and autograd live in
// trainer/ops/cuda.py.
#include <torch/extension.h>

torch::Tensor window_partition_cuda(const torch::Tensor& x, int64_t window, int64_t shift);
torch::Tensor window_merge_cuda(const torch::Tensor& windows, int64_t window, int64_t shift, int64_t H, int64_t W);
torch::Tensor window_softmax_forward_cuda(const torch::Tensor& logits, const torch::Tensor& table,
                                          const torch::Tensor& index, const c10::optional<torch::Tensor>& mask);
std::vector<torch::Tensor> window_softmax_backward_cuda(const torch::Tensor& probs, const torch::Tensor& grad);
std::vector<torch::Tensor> window_attention_forward_cuda(const torch::Tensor& qkv, const torch::Tensor& table,
                                                         const torch::Tensor& index,
                                                         const c10::optional<torch::Tensor>& mask, double scale);
std::vector<torch::Tensor> window_attention_backward_cuda(const torch::Tensor& grad_out, const torch::Tensor& qkv,
                                                          const torch::Tensor& lse, const torch::Tensor& table,
                                                          const torch::Tensor& index,
                                                          const c10::optional<torch::Tensor>& mask, double scale);
std::vector<at::Tensor> fused_mlp_forward_cuda(const at::Tensor& x, const at::Tensor& w1, const at::Tensor& b1,
                                               const at::Tensor& w2, const at::Tensor& b2);
std::vector<at::Tensor> fused_mlp_backward_cuda(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& pre,
                                                const at::Tensor& act, const at::Tensor& w1, const at::Tensor& w2);
void master_adamw_cuda(const std::vector<torch::Tensor>& grads, const std::vector<torch::Tensor>& params,
                       const std::vector<torch::Tensor>& masters, const std::vector<torch::Tensor>& exp_avgs,
                       const std::vector<torch::Tensor>& exp_avg_sqs, const std::vector<torch::Tensor>& steps,
                       const std::vector<double>& lrs, const std::vector<double>& decays, double beta1, double beta2,
                       double eps, const c10::optional<torch::Tensor>& grad_factor, int64_t parts,
                       int64_t part_stride);
torch::Tensor parts_sum_of_squares_cuda(const torch::Tensor& flat, int64_t parts);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("window_partition", &window_partition_cuda, "cyclic shift + window partition (CUDA)");
  m.def("window_merge", &window_merge_cuda, "window merge + reverse shift (CUDA)");
  m.def("window_softmax_forward", &window_softmax_forward_cuda, "softmax(logits + bias + mask) (CUDA)");
  m.def("window_softmax_backward", &window_softmax_backward_cuda, "its gradients (CUDA)");
  m.def("window_attention_forward", &window_attention_forward_cuda,
        "softmax(q k^T * scale + table[index] + mask) @ v from packed qkv, with the row log-sum-exp (CUDA)");
  m.def("window_attention_backward", &window_attention_backward_cuda, "its qkv and bias-table gradients (CUDA)");
  m.def("fused_mlp_forward", &fused_mlp_forward_cuda,
        "linear -> GELU (tanh) -> linear on cuBLASLt, fc1's bias + GELU in its epilogue; returns the GELU input and "
        "output too");
  m.def("fused_mlp_backward", &fused_mlp_backward_cuda,
        "its gradients: of the GELU input (GELU's derivative in a cuBLASLt epilogue), x, w1 and w2");
  m.def("master_adamw", &master_adamw_cuda,
        "AdamW on float32 masters from bfloat16 gradients (or the mean of their parts), new weights written back to "
        "the bfloat16 model (CUDA)");
  m.def("parts_sum_of_squares", &parts_sum_of_squares_cuda,
        "the sum of squares of the mean of a bfloat16 buffer's equal parts (CUDA)");
}
