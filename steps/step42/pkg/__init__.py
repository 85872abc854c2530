"""One flashladder step: ``attention(q, k, v, scale=None) -> (o, lse)``, and ``sdpa()``, a drop-in for torch's
scaled_dot_product_attention. The kernel and its story: kernel.cu."""
from ._binding import bind_step

attention, attention_out, sdpa, info = bind_step(__name__)
__all__ = ["attention", "attention_out", "sdpa", "info"]
