// What a .cu file that calls one entry point compiles: CMakeLists.txt builds this file to PTX
// with DCMHA_CUDA_HEAD_DIMS=128, and one_call_kernels.sh requires its kernels to be the bf16
// forward's of that class only (the entry points instantiate the storage types a file calls,
// the dispatch the listed classes).
#include <dcmha/cuda/attention.hpp>

void call_bf16_forward(const dcmha::AttentionConfig& cfg, dcmha::TensorView<const dcmha::bf16, 4> q,
                       dcmha::TensorView<const dcmha::bf16, 4> k,
                       dcmha::TensorView<const dcmha::bf16, 4> v,
                       dcmha::TensorView<dcmha::bf16, 4> out, dcmha::TensorView<float, 3> lse,
                       const dcmha::ComposeWeights<dcmha::bf16>& compose,
                       dcmha::cuda::DeviceWorkspace& workspace) {
  dcmha::cuda::forward(cfg, q, k, v, out, lse, compose, workspace);
}
