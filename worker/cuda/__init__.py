"""The CUDA path of the engine: a paged decode attention kernel (Triton) and CUDA-graph decode steps."""
