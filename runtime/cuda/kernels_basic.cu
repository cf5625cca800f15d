// runtime/cuda/kernels_basic.cu: being written (issue 7).
