"""One flashladder step: ``attention(q, k, v, scale=None) -> (o, lse)``. The kernel and its story: kernel.cu."""
from ._binding import bind_step

attention, attention_out, info = bind_step(__name__)
__all__ = ["attention", "attention_out", "info"]
