/* The CUDA backend's routing kernels, compiled for the CPU emulation. */
#include "qm_cuda_route.cu"
