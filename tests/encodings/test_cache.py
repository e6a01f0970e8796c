"""The encoding's cache (encodings/cache.py) and the `Positions` value: what each scope keeps and
when it lets go, counted by hand."""
import copy
import pickle

import torch

from posenc_fairseq.encodings import ModelDims, build_encoding
from posenc_fairseq.encodings.cache import equal_at_once, equal_values, same_values, use_kept_values, value_copies
from posenc_fairseq.encodings.positions import bounds, shared_range, tensor_of
from position_terms import position_range
from util import HostReads, encoding_options


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
        encoding.memoize(encoding.term_key(role, "term"), counting(computed, role))
        encoding.memoize(encoding.term_key(role, "term"), counting(computed, role))  # a hit
    with torch.no_grad():
        encoding.memoize(encoding.term_key("encoder", "term"), counting(computed, "encoder without grad"))
    assert computed == ["encoder", "decoder", "encoder without grad"]
    encoding.begin("decoder")  # drops the decoder's only
    encoding.memoize(encoding.term_key("encoder", "term"), counting(computed, "again"))
    encoding.memoize(encoding.term_key("decoder", "term"), counting(computed, "decoder again"))
    assert computed[3:] == ["decoder again"]
    encoding.memoize(encoding.term_key("encoder", "term", 0, 3), counting(computed, "other distances"))
    assert computed[4:] == ["other distances"]


def test_a_cross_attention_term_is_let_go_with_the_decoders_pass():
    """A term memoized by the cross-attention (role 'cross') belongs to the decoder's pass: its
    `end` and next `begin` drop it, as for the decoder's self-attention; the encoder's do not."""
    encoding, computed = t5(), []
    key = encoding.term_key("cross", "term")
    first = encoding.memoize(key, counting(computed, "cross"))
    encoding.begin("encoder")
    encoding.end("encoder")
    assert encoding.memoize(key, counting(computed, "cross")) is first and len(computed) == 1
    encoding.end("decoder")
    assert encoding.memoize(key, counting(computed, "cross")) is not first and len(computed) == 2
    encoding.begin("decoder")
    encoding.memoize(key, counting(computed, "cross"))
    assert len(computed) == 3


def test_a_recorded_run_replays_its_forwards_hits_and_misses():
    """The second run of a `recorded` function (the recomputation of a checkpoint) computes exactly
    the terms the first computed and takes from the pass scope the ones the first found there: its
    forward's pass scope, also where another pass has begun in between (the same tensors)."""
    for another_pass_between in (False, True):
        encoding, computed = t5(), []
        weight = torch.ones((), requires_grad=True)

        def term(name):
            def compute():
                computed.append((name, torch.is_grad_enabled()))
                return weight * len(computed)
            return encoding.memoize(encoding.term_key("encoder", name), compute)

        term("before")  # memoized before the run: the first run finds it
        run = encoding.recorded(lambda: [term(name) for name in ("before", "new", "new", "other")])
        first = run()
        assert computed == [("before", True), ("new", True), ("other", True)]  # the second "new" was found
        computed.clear()
        if another_pass_between:
            encoding.begin("encoder")
            later = term("before")  # the later pass's own value
        computed.clear()
        replay = run()
        assert computed == [("new", True), ("other", True)]
        assert replay[0] is first[0] and replay[2] is first[1]  # taken from the forward's pass scope
        assert replay[1].grad_fn is not None and replay[3].grad_fn is not None  # computed as the first run did
        assert not encoding.in_recorded_run()
        if another_pass_between:  # and the later pass's scope is back after the replay
            assert term("before") is later and computed == [("new", True), ("other", True)]


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


def test_the_check_by_value_answers_as_torch_equal():
    """`equal_values` (numpy's comparison for large CPU tensors) answers as torch.equal: a change in one
    element of a large tensor, NaN, -0.0, strided views, bf16 (torch's own comparison), parameters."""
    large = torch.randn(200, 200)
    pairs = [(large, large.clone()), (large.t(), large.t().clone()), (large[:, ::2], large[:, ::2].clone())]
    changed = large.clone()
    changed[123, 45] += 1e-6
    nan = large.clone()
    nan[7, 7] = float("nan")
    zero = torch.zeros(200, 200)
    pairs += [(large, changed), (nan, nan.clone()), (zero, -zero), (large.double(), large.double().clone()),
              (large.half(), large.half().clone()), (large.bfloat16(), large.bfloat16().clone()),
              (large.clone(), torch.nn.Parameter(large.clone())), (torch.randn(5), torch.randn(5))]
    for copy_, tensor in pairs:
        assert equal_values(copy_, tensor) == torch.equal(copy_, tensor)
    parameter = torch.nn.Parameter(large.clone())
    copies = value_copies([parameter])
    assert same_values(copies, [parameter])
    with torch.no_grad():
        parameter.data[199, 99] += 1.0  # as fairseq's optimizers: through .data
    assert not same_values(copies, [parameter])


def test_the_check_on_an_accelerator_answers_as_torch_equal_in_one_read(device):
    """`equal_at_once` (what `same_values` runs for tensors off the CPU) answers as torch.equal per pair,
    over every pair at once: a change in one element of any tensor, NaN, -0.0, strided views, two
    dtypes; on a GPU `same_values` then waits for the device once per dtype, not once per tensor."""
    torch.manual_seed(0)
    tensors = [torch.randn(40, 30), torch.randn(30).t(), torch.randn(16, 8)[:, ::2], torch.randn(7).double()]
    tensors = [tensor.to(device) for tensor in tensors]
    copies = value_copies(tensors)
    assert equal_at_once(list(zip(copies, tensors))) and same_values(copies, tensors)
    for index, position in [(0, (39, 29)), (2, (15, 3)), (3, (6,))]:
        changed = [tensor.clone() for tensor in tensors]
        changed[index][position] += 1e-6 if changed[index].dtype == torch.float32 else 1e-12
        assert not equal_at_once(list(zip(copies, changed))) and not same_values(copies, changed)
    nan = tensors[0].clone()
    nan[1, 1] = float("nan")
    zero = torch.zeros(4, device=device)
    for copy_, tensor in [(nan, nan.clone()), (zero, -zero), (tensors[0], tensors[0].clone())]:
        assert equal_at_once([(copy_, tensor)]) == torch.equal(copy_, tensor)
    with HostReads() as host:
        assert same_values(copies, tensors)
    assert len(host.reads) == (len(tensors) if torch.device(device).type == "cpu" else 2)  # (two dtypes)


def test_copies_of_an_encoding_start_with_an_empty_cache_of_their_own():
    encoding = t5()
    encoding.begin("encoder", shared_range(2, 0, 3))
    encoding.memoize(encoding.term_key("encoder", "term"), lambda: torch.ones(2, requires_grad=True) * 2)  # holds a graph
    encoding.cache.constant("c", lambda: 1)
    for copied in (copy.deepcopy(encoding), pickle.loads(pickle.dumps(encoding))):
        assert copied.cache is not encoding.cache
        assert copied.cache.pass_values == {} and copied.cache.constants == {} and copied.contexts == {}
    assert encoding.cache.pass_values and encoding.cache.constants  # the original keeps its own


def test_positions_carry_their_bounds_and_a_tensor_is_read():
    positions = position_range(2, 6)
    assert (positions.start, positions.stop, len(positions)) == (2, 6, 4)
    assert bounds(positions) == (2, 5) and tensor_of(positions).tolist() == [2, 3, 4, 5]
    assert bounds(torch.tensor([7, 3, 5])) == (3, 7)  # arbitrary positions: read from the tensor
    assert position_range(2, 6) == positions  # a value: equal by its bounds


def test_begin_makes_the_pass_context_of_its_stack():
    """The context holds the positions as given (a range stays a `Positions`), the decoder's source
    positions (kept by a later decoding step that gives none), `earlier` and the FlexAttention
    switch of the pass; each stack has its own, and the next `begin` of a stack replaces it."""
    encoding = t5()
    announced = shared_range(3, 0, 4)
    source = torch.zeros(3, 5, dtype=torch.long)
    encoder = encoding.begin("encoder", announced)
    assert encoding.contexts == {"encoder": encoder}
    assert (encoder.stack, encoder.positions, encoder.source, encoder.earlier) == ("encoder", announced, None, 0)
    assert encoder.flex_mode == "off" and encoder.future_mask is None
    first = encoding.begin("decoder", shared_range(3, 0, 1), source)
    step = encoding.begin("decoder", shared_range(3, 1, 2), earlier=1)
    assert step is not first and encoding.contexts == {"encoder": encoder, "decoder": step}
    assert step.source is source and step.positions == position_range(1, 2) and step.earlier == 1
    assert step.key_positions("cross") is source and step.key_positions("decoder") is step.positions