"""AT5 and AT5-NoB: the bias each head receives against a naive double loop over (i, j) from the
paper's equations 17-20, the prior, saturation on long inputs, identity reset, gradients, the
parameterisation (same bias as the old relu/plain-weight one at init and from an old checkpoint,
gamma cannot die, larger Adam steps), and training through fairseq-train."""
import math

import pytest
import torch

from posenc_fairseq.encodings import ModelDims, build_encoding
from posenc_fairseq.encodings.at5 import GAMMA_STEP_SCALE, MAX_GAMMA, MLP_STEP_SCALE, HeadMLPs, raw_gamma
from posenc_fairseq.encodings.prior import prior_distribution
from position_terms import logits_between
from util import encoding_options, QUICK_TRAIN, TINY_ROBERTA, TINY_TRANSFORMER, USER_DIR, build_model, random_batch, run


def make(name, layers=2, heads=3, **options):
    args = encoding_options(**options)
    torch.manual_seed(0)
    return build_encoding(name, args, ModelDims(embed_dim=12, heads=heads, encoder_layers=layers, decoder_layers=layers))


def sigmoid(x):
    return 1 / (1 + math.exp(-x))


def effective_parameters(mlp):
    """{'w1': .., 'b3': ..}: the weights the MLP computes with."""
    return {name: getattr(mlp, name) for name in HeadMLPs.PARAMETERS}


def naive_mlp(params, head, x, activation=sigmoid, mask=None):
    """1 -> h1 -> h2 -> 1 written out with scalars; `mask` (h1 factors, a dropout's) multiplies the
    first hidden layer."""
    w1, b1, w2, b2, w3, b3 = (params[name][head].tolist() for name in ("w1", "b1", "w2", "b2", "w3", "b3"))
    hidden1 = [activation(w1[k] * x + b1[k]) * (1 if mask is None else mask[k]) for k in range(len(w1))]
    hidden2 = [activation(sum(hidden1[k] * w2[k][m] for k in range(len(w1))) + b2[m]) for m in range(len(b2))]
    return sum(hidden2[m] * w3[m] for m in range(len(b2))) + b3


def naive_at5(encoding, role, i, j, head, nob, gammas=None, mlps=None, activation=sigmoid):
    """e_h(j - i): paper eqs. 17-20 with A = 1 / length scale; d > 0 uses the + branch, d <= 0
    the - branch; the causal decoder only has the - branch (future keys read d = 0). `gammas`
    ({name: (heads,) gamma as the paper's free parameter}, used as max(0, gamma)) and `mlps`
    ({name: {'w1': ..}}) default to the encoding's effective values."""
    d = j - i
    A = 1 / encoding.length_scale
    if role == "decoder":
        d = min(d, 0)
    direction = "plus" if d > 0 else "minus"
    name = f"{role}_{direction}"
    if nob:
        x = min(abs(d) * A, 1.0)
    else:
        gamma = max(0.0, (gammas[name] if gammas else encoding.gamma(name))[head].item())
        x = 1 - math.exp(-d * A * gamma) if d > 0 else 1 - math.exp(d * A * gamma)
    params = mlps[name] if mlps else effective_parameters(encoding.mlps[name])
    return naive_mlp(params, head, x, activation)


@pytest.mark.parametrize("role", ["encoder", "decoder"])
@pytest.mark.parametrize("name", ["at5", "at5_nob"])
def test_bias_equals_naive_double_loop(name, role):
    encoding = make(name, at5_length_scale=16.0, at5_mlp_widths=[5, 3]).double()
    if name == "at5":  # one head with a small gamma: its bucket stays near 0
        with torch.no_grad():
            encoding.raw_gammas[f"{role}_minus"][1] = raw_gamma(torch.tensor(0.05))
    encoding.eval()
    queries, keys = torch.arange(10, 30), torch.arange(0, 45)
    encoding.begin(role)
    bias = logits_between(encoding, role, 0, None, None, queries, keys, dtype=torch.float64)
    assert bias.shape == (3, 20, 45)
    for head in range(3):
        for qi, i in enumerate(queries.tolist()):
            for kj, j in enumerate(keys.tolist()):
                expected = naive_at5(encoding, role, i, j, head, nob=name == "at5_nob")
                assert abs(bias[head, qi, kj].item() - expected) < 1e-10, (head, i, j)


def test_options_and_parameter_layout():
    encoding = make("at5", at5_gamma_range=[2.0, 3.0], at5_mlp_widths=[7, 2], at5_activation="relu")
    names = dict(encoding.named_parameters())
    assert set(names) == {f"{p}.{key}_{direction}{suffix}"
                          for key, directions in (("encoder", ("minus", "plus")), ("decoder", ("minus",)))
                          for direction in directions
                          for p, suffixes in (("raw_gammas", ("",)),
                                              ("mlps", (".w1_raw", ".b1_raw", ".w2_raw", ".b2_raw", ".w3_raw", ".b3_raw")))
                          for suffix in suffixes}
    for direction in ("encoder_minus", "encoder_plus", "decoder_minus"):
        gamma = encoding.gamma(direction)
        assert gamma.shape == (3,) and (gamma >= 2 - 1e-5).all() and (gamma <= 3 + 1e-5).all()
    assert names["mlps.encoder_plus.w2_raw"].shape == (3, 7, 2)
    spread = make("at5", heads=4, at5_gamma_range=[2.0, 250.0], at5_gamma_init="geometric")
    for direction in ("encoder_minus", "encoder_plus", "decoder_minus"):  # 2 * 5 ** k, by hand
        assert torch.allclose(spread.gamma(direction), torch.tensor([2.0, 10.0, 50.0, 250.0]), rtol=1e-6)
    assert torch.allclose(make("at5", heads=1, at5_gamma_range=[2.0, 250.0], at5_gamma_init="geometric")
                          .gamma("encoder_plus"), torch.tensor([250.0]), rtol=1e-6)
    # the default: geometric from 1 to the length scale L (A * gamma from 1/L to 1), L = 256 unless set
    assert torch.allclose(make("at5", heads=5).gamma("encoder_minus"), torch.tensor([1.0, 4.0, 16.0, 64.0, 256.0]),
                          rtol=1e-6)
    assert torch.allclose(make("at5", heads=3, at5_length_scale=49.0).gamma("decoder_minus"),
                          torch.tensor([1.0, 7.0, 49.0]), rtol=1e-6)
    uniform = make("at5", heads=64, at5_gamma_init="uniform").gamma("encoder_plus")
    assert uniform.min() >= 1 and uniform.max() <= 256 and len(set(uniform.tolist())) == 64
    assert "raw_gammas" not in {name.split(".")[0] for name, _ in make("at5_nob").named_parameters()}
    every = make("at5", scalar_bias_layers="all")
    assert {name.split(".")[1] for name, _ in every.named_parameters()} == {
        "encoder_0_minus", "encoder_0_plus", "encoder_1_minus", "encoder_1_plus", "decoder_0_minus", "decoder_1_minus"}
    assert logits_between(make("at5"), "cross", 0, None, None, torch.arange(3), torch.arange(4)) is None


@pytest.mark.parametrize("role", ["encoder", "decoder"])
@pytest.mark.parametrize("name", ["at5", "at5_nob"])
def test_prior_sums_to_one(name, role):
    encoding = make(name)
    encoding.eval()
    prior = prior_distribution(encoding, role, 0, 20, torch.arange(64), head=1)
    assert prior.shape == (64,) and abs(prior.sum().item() - 1) < 1e-6
    visible = 21 if role == "decoder" else 64
    bias = logits_between(encoding, role, 0, None, None, torch.tensor([20]), torch.arange(64))[1, 0]
    assert torch.allclose(prior[:visible], torch.softmax(bias[:visible], -1)) and (prior[visible:] == 0).all()


def naive_nob_learned(encoding, role, i, j, head):
    """The authors' AT5-NoB code: MLP_h(sigmoid(s_h[d])) with one learned scalar per head and
    relative position d = j - i clipped to +-floor(L) (causal decoder: d <= 0), one MLP per head."""
    limit = int(encoding.length_scale)
    d = max(-limit, min(limit, j - i))
    if role == "decoder":
        d = min(d, 0)
    s = encoding.inputs[role][head, d + limit].item()
    return naive_mlp(effective_parameters(encoding.mlps[f"{role}_both"]), head, sigmoid(s))


@pytest.mark.parametrize("role", ["encoder", "decoder"])
def test_nob_learned_input_equals_the_authors_formula(role):
    encoding = make("at5_nob", at5_nob_input="learned", at5_length_scale=8.0, at5_mlp_widths=[5, 3]).double()
    assert encoding.inputs["encoder"].shape == (3, 17) and encoding.inputs["decoder"].shape == (3, 9)
    assert ((encoding.inputs[role] >= 0) & (encoding.inputs[role] < 1)).all()  # U(0, 1), as the authors' code
    assert sorted(encoding.mlps) == ["decoder_both", "encoder_both"] and len(encoding.raw_gammas) == 0
    with torch.no_grad():
        encoding.inputs[role].add_(torch.randn_like(encoding.inputs[role]))
    encoding.eval()
    queries, keys = torch.arange(10, 30), torch.arange(0, 45)  # distances beyond +-8 are clipped
    encoding.begin(role)
    bias = logits_between(encoding, role, 0, None, None, queries, keys, dtype=torch.float64)
    for head in range(3):
        for qi, i in enumerate(queries.tolist()):
            for kj, j in enumerate(keys.tolist()):
                assert abs(bias[head, qi, kj].item() - naive_nob_learned(encoding, role, i, j, head)) < 1e-10
    # the default stays the paper's text: min(|d| / L, 1), no input table
    assert len(make("at5_nob").inputs) == 0 and make("at5_nob").nob_input == "distance"


def test_nob_learned_input_gets_gradients_and_resets_to_identity():
    encoding = make("at5_nob", at5_nob_input="learned", at5_length_scale=8.0, scalar_bias_layers="all")
    encoding.begin("encoder")
    logits_between(encoding, "encoder", 1, None, None, torch.arange(12), torch.arange(12)).sum().backward()
    assert encoding.inputs["encoder_1"].grad.abs().sum() > 0
    encoding.reset_to_identity()
    encoding.begin("decoder")
    assert (logits_between(encoding, "decoder", 0, None, None, torch.arange(9), torch.arange(9)) == 0).all()


def test_prior_has_dropout_off_and_leaves_the_encoding_as_it_was():
    encoding = make("at5", at5_dropout=0.5)
    encoding.train()
    encoding.begin("encoder")
    cached = encoding.distance_term("encoder", 0, -4, 4, 5, torch.float32).bias  # memoized for this pass
    memo = {role: dict(values) for role, values in encoding.cache.pass_values.items()}
    priors = [prior_distribution(encoding, "encoder", 0, 3, torch.arange(30), head=0) for _ in range(3)]
    assert encoding.training and encoding.cache.pass_values == memo
    assert encoding.distance_term("encoder", 0, -4, 4, 5, torch.float32).bias is cached
    assert all(torch.equal(priors[0], prior) for prior in priors)  # no dropout noise
    encoding.eval()
    with torch.no_grad():
        bias = logits_between(encoding, "encoder", 0, None, None, torch.tensor([3]), torch.arange(30))
        expected = torch.softmax(bias[0, 0], -1)
    assert torch.allclose(priors[0], expected)


def test_dropout_acts_on_the_first_hidden_layer():
    """--at5-dropout drops units of the first hidden layer (width H1), not of the second: with the
    MLP's dropout replaced by a fixed one (unit 0 dropped, the others scaled by 1 / (1 - p)), the MLP
    equals the naive MLP with that mask on its first hidden layer."""
    encoding = make("at5", at5_mlp_widths=[5, 3], at5_dropout=0.5).double()
    mlp = encoding.mlps["encoder_plus"]
    widths = []

    class FixedDropout(torch.nn.Module):
        def forward(self, hidden):
            widths.append(hidden.size(-1))
            mask = torch.full((hidden.size(-1),), 2.0, dtype=hidden.dtype)
            mask[0] = 0
            return hidden * mask

    mlp.dropout = FixedDropout()
    x = torch.rand(3, 7, dtype=torch.float64)
    with torch.no_grad():
        got = mlp(x)
    assert widths == [5]
    params = effective_parameters(mlp)
    for head in range(3):
        for k in range(7):
            expected = naive_mlp(params, head, x[head, k].item(), mask=[0, 2, 2, 2, 2])
            assert abs(got[head, k].item() - expected) < 1e-12, (head, k)


def test_gamma_is_capped_so_that_the_bias_stays_finite():
    """A learned gamma pushed far up (exp(8 * 100) overflows) is capped at MAX_GAMMA: the bias at
    distances 0..9, d = 0 included (where an infinite gamma would give inf * 0 = NaN), is finite and
    equals the naive formula with gamma = MAX_GAMMA."""
    encoding = make("at5").eval()
    with torch.no_grad():
        for raw in encoding.raw_gammas.values():
            raw.fill_(100.0)
    for name in encoding.raw_gammas:
        assert torch.allclose(encoding.gamma(name), torch.full((3,), MAX_GAMMA), rtol=1e-6), name
    gammas = {name: torch.full((3,), MAX_GAMMA) for name in encoding.raw_gammas}
    for role in ("encoder", "decoder"):
        encoding.begin(role)
        with torch.no_grad():
            bias = logits_between(encoding, role, 0, None, None, torch.arange(10), torch.arange(10))
        assert torch.isfinite(bias).all(), role
        for head in range(3):
            for i in range(10):
                for j in range(10):
                    expected = naive_at5(encoding, role, i, j, head, nob=False, gammas=gammas)
                    assert abs(bias[head, i, j].item() - expected) < 1e-5, (role, head, i, j)


def test_reset_to_identity_adds_zero():
    for name in ("at5", "at5_nob"):
        encoding = make(name, scalar_bias_layers="all")
        encoding.reset_to_identity()
        for role in ("encoder", "decoder"):
            encoding.begin(role)
            for layer in (0, 1):
                assert (logits_between(encoding, role, layer, None, None, torch.arange(9), torch.arange(9)) == 0).all()


def test_bias_saturates_beyond_the_length_scale():
    """b -> 1 as |d| grows, so the bias of very long distances converges instead of growing."""
    encoding = make("at5")
    encoding.eval()
    with torch.no_grad():
        far = logits_between(encoding, "encoder", 0, None, None, torch.tensor([0]), torch.tensor([50_000, 100_000]))
        near_limit = encoding.mlps["encoder_plus"](torch.ones(3, 1))[:, 0]
    assert torch.isfinite(far).all()
    assert torch.allclose(far[:, 0, 0], near_limit, atol=1e-6) and torch.allclose(far[:, 0, 1], near_limit, atol=1e-6)


@pytest.mark.parametrize("name", ["at5", "at5_nob"])
def test_runs_on_1000_tokens(translation_data, name):
    model, task, _ = build_model(translation_data, f"transformer_{name}", TINY_TRANSFORMER)
    model.eval()
    src, src_lengths, prev = random_batch(task.source_dictionary, batch=1, src_len=1000, tgt_len=1000)
    with torch.no_grad():
        logits, _ = model(src, src_lengths, prev)
        positions = torch.arange(1000)
        bias = logits_between(model.positional_encoding, "encoder", 0, None, None, positions, positions)
    assert torch.isfinite(logits).all() and torch.isfinite(bias).all()
    if name == "at5_nob":  # the input is clipped at the length scale: constant beyond it
        assert (bias[:, 0, 256:] == bias[:, 0, 256:257]).all()


@pytest.mark.parametrize("name", ["at5", "at5_nob"])
def test_gradients_reach_gamma_and_mlp(translation_data, name):
    model, task, _ = build_model(translation_data, f"transformer_{name}", [*TINY_TRANSFORMER, "--at5-dropout", "0.1"])
    src, src_lengths, prev = random_batch(task.source_dictionary)
    logits, _ = model(src, src_lengths, prev)
    logits.logsumexp(-1).mean().backward()
    names = dict(model.positional_encoding.named_parameters())
    assert any(name.startswith("raw_gammas.") for name in names) == (name == "at5")
    for parameter_name, parameter in names.items():
        assert parameter.grad is not None and parameter.grad.abs().sum() > 0, parameter_name


@pytest.mark.parametrize("arch,extra", [
    ("transformer_at5", []),
    ("transformer_at5_nob", []),
    ("transformer_at5_nob", ["--at5-nob-input", "learned", "--at5-length-scale", "16"]),  # the authors' variant
])
def test_fairseq_train_translation(translation_data, tmp_path, arch, extra):
    out = run(["fairseq-train", translation_data, "--user-dir", USER_DIR, "--arch", arch, *TINY_TRANSFORMER,
               *QUICK_TRAIN, "--save-dir", tmp_path, "--max-update", "3",
               "--at5-mlp-widths", "8", "2", "--at5-gamma-range", "0.1", "10", "--at5-activation", "relu", *extra])
    assert "num_updates 3" in out


@pytest.mark.parametrize("arch", ["roberta_at5", "roberta_at5_nob"])
def test_fairseq_train_roberta(masked_lm_data, tmp_path, arch):
    out = run(["fairseq-train", masked_lm_data, "--user-dir", USER_DIR, "--task", "masked_lm", "--arch", arch,
               "--tokens-per-sample", "64", *TINY_ROBERTA, *QUICK_TRAIN, "--save-dir", tmp_path, "--max-update", "3",
               "--scalar-bias-layers", "all", "--scalar-bias-share-layers"])
    assert "num_updates 3" in out


# --- the parameterisation (issue 27): same bias as the old one, gamma cannot die, larger Adam steps ---

def old_initial_values(seed, heads=3, widths=(32, 4), gamma_range=(1.0, 10.0)):
    """What the old code drew at `make`'s seed: per parameter set (encoder minus, plus, decoder
    minus), nn.Linear's U(+-1/sqrt(fan_in)) for w1, b1, w2, b2, w3, b3, then gamma U(range)."""
    h1, h2 = widths
    torch.manual_seed(seed)
    gammas, mlps = {}, {}
    for name in ("encoder_minus", "encoder_plus", "decoder_minus"):
        shapes = [((heads, h1), 1), ((heads, h1), 1), ((heads, h1, h2), h1), ((heads, h2), h1), ((heads, h2), h2),
                  ((heads,), h2)]
        values = [torch.empty(shape).uniform_(-fan_in ** -0.5, fan_in ** -0.5) for shape, fan_in in shapes]
        mlps[name] = dict(zip(HeadMLPs.PARAMETERS, values))
        gammas[name] = torch.empty(heads).uniform_(*gamma_range)
    return gammas, mlps


def assert_bias_is_naive(encoding, gammas, mlps, tolerance, roles=("encoder", "decoder")):
    encoding.eval()
    for role in roles:
        encoding.begin(role)
        with torch.no_grad():
            bias = logits_between(encoding, role, 0, None, None, torch.arange(12), torch.arange(12))
        for head in range(3):
            for i in range(12):
                for j in range(12):
                    expected = naive_at5(encoding, role, i, j, head, nob=False, gammas=gammas, mlps=mlps)
                    assert abs(bias[head, i, j].item() - expected) < tolerance, (role, head, i, j)


def test_bias_at_init_is_the_old_parameterisations():
    """Same seed, same draws: the bias the old relu(gamma) / plain-weight code started from (with the
    old code's initialisation of gamma, the paper's uniform draws in [1, 10])."""
    gammas, mlps = old_initial_values(seed=0)
    encoding = make("at5", at5_gamma_init="uniform", at5_gamma_range=[1.0, 10.0])  # seeds 0 itself
    for name, values in mlps.items():  # the MLP weights: bit for bit (the scale is a power of two)
        for parameter, value in values.items():
            assert torch.equal(getattr(encoding.mlps[name], parameter), value), (name, parameter)
        assert torch.allclose(encoding.gamma(name), gammas[name], rtol=1e-6)
    assert_bias_is_naive(encoding, gammas, mlps, tolerance=1e-5)


def test_old_state_dict_loads_to_the_same_bias(masked_lm_data):
    """A checkpoint of the old parameterisation (keys gammas.*, mlps.*.w1 ..; gamma used as
    relu(gamma), one of them negative) loads through fairseq's model.load_state_dict (strict) and
    gives the bias the old formula gives; the encoding's own state dict is in the new form."""
    model, _, _ = build_model(masked_lm_data, "roberta_at5", [*TINY_ROBERTA, "--scalar-bias-layers", "all",
                                                              "--scalar-bias-share-layers"], task="masked_lm")
    encoding = model.positional_encoding
    prefix = next(name for name, module in model.named_modules() if module is encoding) + "."
    generator = torch.Generator().manual_seed(3)
    old, gammas, mlps = {}, {}, {}
    for key, value in model.state_dict().items():
        local = key[len(prefix):]
        if not key.startswith(prefix) or local == "trained_with":
            old[key] = value
            continue
        if local.startswith("raw_gammas."):
            name = local.split(".")[1]
            gammas[name] = torch.rand(value.shape, generator=generator) * 10 - 1  # some below 0
            gammas[name][0] = -0.5
            old[prefix + "gammas." + name] = gammas[name]
        else:  # mlps.NAME.w1_raw -> mlps.NAME.w1 holding the effective value
            _, name, parameter = local.split(".")
            parameter = parameter[:-len("_raw")]
            mlps.setdefault(name, {})[parameter] = torch.randn(value.shape, generator=generator)
            old[f"{prefix}mlps.{name}.{parameter}"] = mlps[name][parameter]
    model.load_state_dict(old, strict=True)
    assert_bias_is_naive(encoding, gammas, mlps, tolerance=1e-4, roles=("encoder",))
    saved = model.state_dict()
    assert not any(".gammas." in key or key.endswith((".w1", ".b3")) for key in saved)
    assert all(torch.equal(saved[prefix + f"mlps.{name}.w2_raw"] * MLP_STEP_SCALE, mlps[name]["w2"]) for name in mlps)


def test_gamma_cannot_die():
    """relu(gamma) of a raw value pushed below 0 has no gradient (its side of the bias is fixed at
    MLP(0) for good); gamma = exp(scale * raw) keeps a gradient after any push down."""
    raw = torch.tensor(-0.5, requires_grad=True)
    (1 - torch.exp(-torch.relu(raw) * 3 / 256)).backward()
    assert raw.grad == 0  # the old parameterisation: dead
    encoding = make("at5")
    optimizer = torch.optim.Adam(encoding.parameters(), lr=0.5)
    for _ in range(30):  # drive every gamma down as hard as Adam goes (b -> 0)
        optimizer.zero_grad()
        sum(encoding.bucket(name, torch.arange(1, 20)).sum() for name in encoding.raw_gammas).backward()
        optimizer.step()
    optimizer.zero_grad()
    for role in ("encoder", "decoder"):
        encoding.begin(role)
        logits_between(encoding, role, 0, None, None, torch.arange(30), torch.arange(30)).pow(2).sum().backward()
    for name, raw in encoding.raw_gammas.items():
        assert (encoding.gamma(name) > 0).all() and (raw.grad != 0).all(), name


@pytest.mark.parametrize("gradient_scale", [1.0, 1e-9])  # a usual gradient and one below Adam's eps
def test_adam_moves_the_effective_parameters_further(gradient_scale):
    """One torch.optim.Adam step on the same loss of the same effective values: the MLP weights move
    at least MLP_STEP_SCALE times as far as plain parameters (the old layout) would, and gamma by a
    relative step of about GAMMA_STEP_SCALE * lr instead of lr / gamma (more where gradients are
    below eps)."""
    lr, name = 1e-3, "encoder_plus"
    encoding = make("at5").double()
    mlp = encoding.mlps[name]
    before = {key: value.detach().clone() for key, value in effective_parameters(mlp).items()}
    gamma_before = encoding.gamma(name).detach().clone()
    plain = {key: value.clone().requires_grad_(True) for key, value in before.items()}
    plain_gamma = gamma_before.clone().requires_grad_(True)
    distance = torch.arange(0, 40, dtype=torch.float64)

    def loss(gamma, params):  # the bias of one side (paper eqs. 17-18) against a fixed target
        bucket = 1 - torch.exp(-gamma[:, None] * distance[None, :] / encoding.length_scale)
        hidden = torch.sigmoid(bucket[:, :, None] * params["w1"][:, None, :] + params["b1"][:, None, :])
        hidden = torch.sigmoid(torch.einsum("hdi,hij->hdj", hidden, params["w2"]) + params["b2"][:, None, :])
        out = torch.einsum("hdj,hj->hd", hidden, params["w3"]) + params["b3"][:, None]
        return gradient_scale * (out * torch.linspace(-1, 2, len(distance))).sum()

    loss(encoding.gamma(name), effective_parameters(mlp)).backward()
    loss(plain_gamma, plain).backward()
    assert torch.allclose(mlp.w1_raw.grad / MLP_STEP_SCALE, plain["w1"].grad, rtol=1e-9, atol=0)  # same loss
    torch.optim.Adam(encoding.parameters(), lr=lr).step()
    torch.optim.Adam([*plain.values(), plain_gamma], lr=lr).step()
    with torch.no_grad():
        for key in HeadMLPs.PARAMETERS:
            new_step, old_step = (getattr(mlp, key) - before[key]).abs(), (plain[key] - before[key]).abs()
            moved = old_step > 0
            ratio = new_step[moved] / old_step[moved]
            assert moved.any() and (ratio >= 0.99 * MLP_STEP_SCALE).all() and (ratio >= 10).all(), key
        new_relative = (encoding.gamma(name) / gamma_before).log().abs()
        old_relative = (plain_gamma / gamma_before).log().abs()
        assert (new_relative > 5 * old_relative).all()
        if gradient_scale == 1.0:  # gradients above eps: Adam's first step is lr per stored value
            assert torch.allclose(new_relative, torch.full_like(new_relative, GAMMA_STEP_SCALE * lr), rtol=0.05)


def test_a_checkpoint_from_before_the_geometric_default_is_refused_then_loads_with_the_override(
        translation_data, tmp_path):
    """A model trained with --at5-gamma-range 0 X (uniform draws, then the only initialisation) and saved
    before --at5-gamma-init existed: loading it now would build a geometric spread from 0, which is
    refused with the way out; with that override it loads to the saved parameters."""
    from fairseq import checkpoint_utils

    run(["fairseq-train", translation_data, "--user-dir", USER_DIR, "--arch", "transformer_at5", *TINY_TRANSFORMER,
         *QUICK_TRAIN, "--save-dir", tmp_path, "--max-update", "2", "--at5-gamma-range", "0", "10",
         "--at5-gamma-init", "uniform"])
    path = tmp_path / "checkpoint_last.pt"
    state = torch.load(path, weights_only=False)
    model_cfg = state["cfg"]["model"]
    if isinstance(model_cfg, dict):
        del model_cfg["at5_gamma_init"]
    else:
        delattr(model_cfg, "at5_gamma_init")
    old = tmp_path / "old.pt"
    torch.save(state, old)
    with pytest.raises(Exception, match="at5_gamma_init': 'uniform'"):
        checkpoint_utils.load_model_ensemble([str(old)])
    models, _ = checkpoint_utils.load_model_ensemble([str(old)], arg_overrides={"at5_gamma_init": "uniform"})
    for name, value in models[0].state_dict().items():
        assert torch.equal(value, state["model"][name]), name


def test_the_kept_bias_follows_the_mlps_activation():
    """The bias kept across calls in inference is recomputed when the MLPs' activation is another (set
    after a call); reference: the naive formula with that activation (before: the sigmoid's bias kept)."""
    encoding = make("at5", layers=1).eval()
    positions = torch.arange(7)
    with torch.no_grad():
        encoding.begin("encoder")
        before = logits_between(encoding, "encoder", 0, None, None, positions, positions)
        for mlp in encoding.mlps.values():
            mlp.activation = torch.tanh
        encoding.begin("encoder")
        after = logits_between(encoding, "encoder", 0, None, None, positions, positions)
    for i, j in [(0, 0), (2, 5), (6, 1)]:
        for head in range(3):
            expected = naive_at5(encoding, "encoder", i, j, head, nob=False, activation=math.tanh)
            assert abs(float(after[head, i, j]) - expected) <= 1e-5
    assert (after - before).abs().max() > 1e-2
