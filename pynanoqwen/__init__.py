"""pynanoqwen: a readable, fast INT4 inference runtime for Qwen2.5 on Hopper GPUs.

Data flows one way: a Hugging Face checkpoint -> `convert` -> a .nanoqwen file (fileformat.py) ->
the numpy reference model (reference.py, CPU) or weights on the GPU (engine/, kernels/, ptx/) ->
tokens (generate.py, tokenizer.py).
"""

__version__ = "0.1.0"
