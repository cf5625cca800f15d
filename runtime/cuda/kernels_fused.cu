// runtime/cuda/kernels_fused.cu: being written (issue 7).
