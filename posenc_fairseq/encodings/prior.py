"""The prior beta of the AT5 paper's eq. 6 (softmax over keys of the token-independent logit bias),
for every encoding: T5, T5-NoB, AT5, AT5-NoB and ALiBi have such a bias; the others give the uniform
prior."""
import torch
from torch import Tensor, nn

from .base import PositionalEncoding
from .distance import bias_between


def _device_and_dtype(encoding: nn.Module):
    for tensor in list(encoding.parameters()) + list(encoding.buffers()):
        if tensor.is_floating_point():
            return tensor.device, tensor.dtype
    return torch.device("cpu"), torch.get_default_dtype()


def prior_distribution(encoding: PositionalEncoding, role: str, layer: int, query_position: int,
                       key_positions, head: int) -> Tensor:
    """The prior beta over the keys of one head (paper eq. 6): softmax over `key_positions` of the
    encoding's token-independent logit bias for query position i = `query_position`.

    Works for every encoding: the bias is its `distance_term` in that layer when that is a bias alone (T5,
    T5-NoB, AT5, AT5-NoB: e_h(j - i); ALiBi: -m_h |j - i|), computed as in the model (its device
    and dtype) but with dropout off (eval mode, restored afterwards) and without touching the
    per-forward cache. In the causal decoder keys after the query get probability 0. A layer,
    role or encoding without such a bias (cross-attention, T5 layers without a table, and the
    encodings whose position terms depend on the tokens: Shaw, LFHC, XL, GCDF, rotary, FLOATER)
    gives the uniform prior. Returns a 1-D float32 tensor (len(key_positions),) on the model's
    device that sums to 1, e.g. to plot with `plt.plot(key_positions, prior.cpu())`.
    """
    device, dtype = _device_and_dtype(encoding)
    keys = torch.as_tensor(key_positions, device=device).long().reshape(-1)
    query = torch.tensor([int(query_position)], device=device)
    training = encoding.training
    encoding.eval()
    try:
        with torch.no_grad(), encoding.cache.apart():
            bias = bias_between(encoding, role, layer, query, keys, dtype)
    finally:
        encoding.train(training)
    scores = torch.zeros(len(keys), device=device) if bias is None else bias[head, 0].float()
    if role == "decoder":
        scores = scores.masked_fill(keys > int(query_position), float("-inf"))
    return torch.softmax(scores, dim=-1)
