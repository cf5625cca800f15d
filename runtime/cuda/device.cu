// runtime/cuda/device.cu: being written (issue 7).
