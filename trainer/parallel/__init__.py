"""Parallelism: the process group and device mesh, and the functions that apply each parallelism to a model."""

from .env import DistEnv, StopVote, expandable_cuda_memory, init_distributed, own_stream, shutdown, widen_cuda_queues
from .mesh import Mesh, ParallelDims, build_mesh, parallel_dims
from .parallelize import Parallelized, parallelize

__all__ = ["DistEnv", "Mesh", "ParallelDims", "Parallelized", "StopVote", "build_mesh", "expandable_cuda_memory",
           "init_distributed", "own_stream", "parallel_dims", "parallelize", "shutdown", "widen_cuda_queues"]
