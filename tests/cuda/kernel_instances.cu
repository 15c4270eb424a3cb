// The entry points' dispatch over head-dim classes; the kernels themselves come from the
// kernel_instance.cu translation units.
#include "kernel_instances.hpp"

template void dcmha::cuda::launch_forward<float>(const char*, dcmha::detail::ForwardParams<float>,
                                                 dcmha::cuda::DeviceWorkspace&, cudaStream_t,
                                                 const dcmha::cuda::LaunchOptions&);
template void dcmha::cuda::launch_backward<float>(const char*, dcmha::detail::BackwardParams<float>,
                                                  dcmha::cuda::DeviceWorkspace&, cudaStream_t,
                                                  const dcmha::cuda::LaunchOptions&);
template void dcmha::cuda::launch_forward<dcmha::bf16>(const char*,
                                                       dcmha::detail::ForwardParams<dcmha::bf16>,
                                                       dcmha::cuda::DeviceWorkspace&, cudaStream_t,
                                                       const dcmha::cuda::LaunchOptions&);
template void dcmha::cuda::launch_backward<dcmha::bf16>(const char*,
                                                        dcmha::detail::BackwardParams<dcmha::bf16>,
                                                        dcmha::cuda::DeviceWorkspace&, cudaStream_t,
                                                        const dcmha::cuda::LaunchOptions&);
template void dcmha::cuda::launch_forward<dcmha::half>(const char*,
                                                       dcmha::detail::ForwardParams<dcmha::half>,
                                                       dcmha::cuda::DeviceWorkspace&, cudaStream_t,
                                                       const dcmha::cuda::LaunchOptions&);
template void dcmha::cuda::launch_backward<dcmha::half>(const char*,
                                                        dcmha::detail::BackwardParams<dcmha::half>,
                                                        dcmha::cuda::DeviceWorkspace&, cudaStream_t,
                                                        const dcmha::cuda::LaunchOptions&);
