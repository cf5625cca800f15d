// runtime/cuda/comm_nccl.cpp: being written (issue 7).
