"""The CUDA backend (CuPy): devices, buffers, streams, NVRTC kernels, cuBLAS, CUDA graphs.

CuPy is imported lazily, inside functions: every module must import on a
machine without a GPU or CuPy.
"""
