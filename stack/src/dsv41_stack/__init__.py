"""dsv41_stack: the DSV41 offload stack's pins, env templates and launcher."""

__version__ = "0.1.0"
