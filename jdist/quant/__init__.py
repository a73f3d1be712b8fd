"""Numbers stored or multiplied in fewer bits: FP8 matmuls (`fp8.py`) and NF4 storage of a
frozen base (`nf4.py`)."""
