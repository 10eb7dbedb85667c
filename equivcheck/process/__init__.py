"""What a process needs to train reproducibly: seeds, threads, kernels, torch's lazy imports, import paths, exit."""
