"""The encoding's cache (encodings/cache.py) and the `Positions` value: what each scope keeps and
when it lets go, counted by hand."""
import copy
import pickle

import torch

from posenc_fairseq.encodings import ModelDims, build_encoding
from posenc_fairseq.encodings.cache import use_kept_values
from posenc_fairseq.encodings.positions import Positions, bounds, position_range, shared_range, tensor_of
from util import encoding_options


def t5(**overrides):
    return build_encoding("t5", encoding_options(**overrides), ModelDims(16, 2, 2, 2))


def counting(computed, value):
    def compute():
        computed.append(value)
        return torch.tensor(float(len(computed)))
    return compute


def test_pass_scope_is_dropped_by_its_roles_begin_and_kept_per_grad_mode():
    encoding, computed = t5(), []
    for role in ("encoder", "decoder"):
        encoding.memoize((role, "term"), counting(computed, role))
        encoding.memoize((role, "term"), counting(computed, role))  # a hit
    with torch.no_grad():
        encoding.memoize(("encoder", "term"), counting(computed, "encoder without grad"))
    assert computed == ["encoder", "decoder", "encoder without grad"]
    encoding.begin("decoder")  # drops the decoder's only
    encoding.memoize(("encoder", "term"), counting(computed, "again"))
    encoding.memoize(("decoder", "term"), counting(computed, "decoder again"))
    assert computed[3:] == ["decoder again"]


def test_inference_scope_is_emptied_by_a_write_through_data_and_kept_otherwise():
    encoding = t5()
    encoding.eval()
    encoding.begin("encoder")
    with torch.no_grad():
        assert use_kept_values(encoding)
        encoding.cache.inference(encoding)["value"] = 1
        encoding.begin("encoder")  # a new pass, parameters as they were: kept
        assert encoding.cache.inference(encoding) == {"value": 1}
        next(encoding.parameters()).data.add_(1.0)  # as fairseq's optimizers: no version moves
        assert encoding.cache.inference(encoding) == {"value": 1}  # checked once per pass
        encoding.begin("encoder")
        assert encoding.cache.inference(encoding) == {}


def test_copies_of_an_encoding_start_with_an_empty_cache_of_their_own():
    encoding = t5()
    encoding.begin("encoder", shared_range(2, 0, 3))
    encoding.memoize(("encoder", "term"), lambda: torch.ones(2, requires_grad=True) * 2)  # holds a graph
    encoding.cache.constant("c", lambda: 1)
    for copied in (copy.deepcopy(encoding), pickle.loads(pickle.dumps(encoding))):
        assert copied.cache is not encoding.cache
        assert copied.cache.pass_values == {} and copied.cache.constants == {} and copied.token_ranges == {}
    assert encoding.cache.pass_values and encoding.cache.constants  # the original keeps its own


def test_positions_carry_their_bounds_and_a_tensor_is_read():
    positions = position_range(2, 6)
    assert (positions.start, positions.stop, len(positions)) == (2, 6, 4)
    assert bounds(positions) == (2, 5) and tensor_of(positions).tolist() == [2, 3, 4, 5]
    assert bounds(torch.tensor([7, 3, 5])) == (3, 7)  # arbitrary positions: read from the tensor
    assert position_range(2, 6) == positions  # a value: equal by its bounds


def test_announced_range_is_found_by_its_tensor_only():
    encoding = t5()
    announced = shared_range(3, 0, 4)
    encoding.begin("encoder", announced, torch.zeros(3, 5, dtype=torch.long))
    assert isinstance(announced, Positions)
    assert encoding.announced_range(encoding.token_positions["encoder"]) is announced
    assert encoding.announced_range(encoding.token_positions["encoder"].clone()) is None  # a copy is any tensor
    assert encoding.announced_range(encoding.token_positions["source"]) is None
