"""Each environment switch is read when used, defaults where unset and refuses an unknown value
(posenc_fairseq/switches.py), for every module that has one."""
import pytest

from posenc_fairseq import switches
from posenc_fairseq.compat import batch_by_size
from posenc_fairseq.encodings.floater import graphs
from posenc_fairseq.kernels import flex, triton_attention


@pytest.mark.parametrize("module,default", [(flex, "off"), (triton_attention, "auto"), (batch_by_size, "on")])
def test_every_switch_defaults_follows_and_refuses(monkeypatch, module, default):
    read = {flex: flex.mode, triton_attention: triton_attention.mode,
            batch_by_size: lambda: "on" if batch_by_size.keeping() else "off"}[module]
    monkeypatch.delenv(module.SWITCH, raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert read() == default
    for value in module.MODES:
        monkeypatch.setenv(module.SWITCH, value)
        assert read() == value
    monkeypatch.setenv(module.SWITCH, "On")
    with pytest.raises(ValueError, match=rf"^{module.SWITCH}='On': expected one of {', '.join(module.MODES)}$"):
        read()


def test_a_count_defaults_follows_and_refuses(monkeypatch):
    monkeypatch.setenv(graphs.ENABLE, "1")
    monkeypatch.delenv(graphs.MIN_WORK, raising=False)
    assert graphs.gpu_min_work() == graphs.DEFAULT_MIN_WORK
    monkeypatch.setenv(graphs.MIN_WORK, "4096")
    assert graphs.gpu_min_work() == 4096
    for bad in ("1e6", "-1", "many", ""):
        monkeypatch.setenv(graphs.MIN_WORK, bad)
        with pytest.raises(ValueError, match=rf"^{graphs.MIN_WORK}='{bad}': expected a whole number >= 0$"):
            graphs.gpu_min_work()
    assert switches.count("POSENC_NOT_SET_ANYWHERE", 7) == 7


def test_the_floater_graphs_switch_is_on_at_1_only_and_refuses_other_values(monkeypatch):
    """Any value but empty or 0 turned the graphs on, 'off' included."""
    monkeypatch.delenv(graphs.ENABLE, raising=False)
    assert not graphs.enabled()
    for value, on in (("", False), ("0", False), ("1", True)):
        monkeypatch.setenv(graphs.ENABLE, value)
        assert graphs.enabled() == on
    for bad in ("off", "true", "on"):
        monkeypatch.setenv(graphs.ENABLE, bad)
        with pytest.raises(ValueError, match=rf"^{graphs.ENABLE}='{bad}': expected one of , 0, 1$"):
            graphs.enabled()
