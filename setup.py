"""Builds the CUDA ops (csrc/) ahead of time when the build can import a CUDA build of torch and find a CUDA
toolkit (pip install --no-build-isolation); otherwise builds nothing, and they are built on first use."""

import os

from setuptools import setup

SOURCES = ["csrc/ops.cpp", "csrc/window_process.cu", "csrc/window_softmax.cu", "csrc/window_attention.cu",
           "csrc/fused_mlp.cpp", "csrc/master_adamw.cu"]


def cuda_extension() -> dict:
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
    except ImportError:
        return {}
    if CUDA_HOME is None or torch.version.cuda is None:
        return {}
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0")  # no GPU is needed at build time
    extension = CUDAExtension("vitctl_cuda_ops", SOURCES,
                              extra_compile_args={"cxx": ["-O3"], "nvcc": ["-O3", "-lineinfo"]})
    return {"ext_modules": [extension], "cmdclass": {"build_ext": BuildExtension}}


setup(**cuda_extension())
