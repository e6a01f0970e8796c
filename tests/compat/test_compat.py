"""The fixes to fairseq, torch and numpy are applied once, each only where needed, each with its
reason (posenc_fairseq/compat/). Run in fresh processes: the root-logger fix only acts when the
plugin is what first imports fairseq."""
import json
import sys

from util import run

PATCHES = ["root_logger", "batch_by_size", "checkpoint_loading", "numpy_compat_long", "option_errors"]


def printed_json(code):
    out = run([sys.executable, "-c", code])
    return json.loads([line for line in out.splitlines() if line.startswith("{")][-1])


def test_apply_is_idempotent_and_says_why_each_patch_was_applied():
    code = """if True:
        import json, sys
        import numpy, torch
        import posenc_fairseq
        from posenc_fairseq import compat
        from fairseq.data import data_utils

        def patched():
            return data_utils.batch_by_size, sys.excepthook, numpy.compat, len(torch.serialization.get_safe_globals())

        first, before = dict(compat.applied), patched()
        again = compat.apply()
        print(json.dumps({"first": first, "again": again, "unchanged": patched() == before,
                          "names": [compat.name_of(patch) for patch in compat.PATCHES],
                          "numpy": int(numpy.__version__.split(".")[0])}))
    """
    done = printed_json(code)
    assert done["names"] == PATCHES
    # fairseq-fixed 0.12.3.1 and torch >= 2.6 (the Makefile's) have every bug; numpy 1 still has np.compat
    expected = [name for name in PATCHES if done["numpy"] >= 2 or name != "numpy_compat_long"]
    assert list(done["first"]) == expected
    assert all(reason.strip() for reason in done["first"].values())
    assert done["again"] == done["first"] and done["unchanged"]


def test_a_patch_is_skipped_where_its_problem_is_absent():
    """fairseq imported first (as its commands do): no root logger of ours to put back; torch told to
    load checkpoints unsafely: nothing to allow-list. Shown by the report a user asks for."""
    code = "import fairseq, runpy; runpy.run_module('posenc_fairseq.compat', run_name='__main__')"
    out = run([sys.executable, "-c", code], env={"TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"})
    report = dict(line.split(": ", 1) for line in out.splitlines() if line.split(":")[0] in PATCHES)
    assert list(report) == PATCHES
    assert report["root_logger"] == report["checkpoint_loading"] == "not needed here"
    assert "drops a last batch" in report["batch_by_size"]


def test_an_option_error_is_one_line_unless_posenc_debug_asks_for_the_traceback(monkeypatch, capsys):
    import posenc_fairseq  # noqa: F401  (installs the hook)
    from posenc_fairseq.encodings.option_types import OptionValueError

    try:
        try:
            raise KeyError("the cause")
        except KeyError as cause:
            raise OptionValueError("--t5-num-buckets 7: expected an even integer") from cause
    except OptionValueError as error:
        refusal = error
    monkeypatch.delenv("POSENC_DEBUG", raising=False)
    sys.excepthook(OptionValueError, refusal, refusal.__traceback__)
    err = capsys.readouterr().err
    assert err.endswith("error: --t5-num-buckets 7: expected an even integer\n") and "Traceback" not in err
    monkeypatch.setenv("POSENC_DEBUG", "1")
    sys.excepthook(OptionValueError, refusal, refusal.__traceback__)
    err = capsys.readouterr().err
    assert "Traceback" in err and "KeyError: 'the cause'" in err


def test_an_option_error_that_fairseq_re_raised_keeps_fairseqs_words_beside_it(monkeypatch, capsys):
    """fairseq's trainer turns any failed checkpoint load into `Exception("Cannot load model
    parameters ...")`, raised while handling ours: one line with both."""
    import posenc_fairseq  # noqa: F401  (installs the hook)
    from posenc_fairseq.encodings.option_types import OptionValueError

    try:
        try:
            raise OptionValueError("--input-positions none: the checkpoint has a learned input position table")
        except Exception:
            raise Exception("Cannot load model parameters from checkpoint x.pt")
    except Exception as error:
        wrapped = error
    monkeypatch.delenv("POSENC_DEBUG", raising=False)
    sys.excepthook(Exception, wrapped, wrapped.__traceback__)
    assert capsys.readouterr().err.endswith(
        "error: Cannot load model parameters from checkpoint x.pt (--input-positions none: the checkpoint has a "
        "learned input position table)\n")
    plain = ValueError("not ours")
    sys.excepthook(ValueError, plain, None)
    err = capsys.readouterr().err
    assert "error: not ours" not in err and "ValueError: not ours" in err


def test_numpy_compat_long_is_numpy_1s_int():
    """numpy 1's `numpy.compat.long` is Python's `int`, the dtype fairseq gives TokenBlockDataset's
    offsets (break mode eos): under numpy 2 the patch gives back exactly that, an integer dtype."""
    import numpy

    import posenc_fairseq  # noqa: F401  (applies the patches)

    assert numpy.compat.long is int
    from fairseq.data import TokenBlockDataset

    blocks = TokenBlockDataset([numpy.arange(3), numpy.arange(2)], numpy.array([3, 2]), block_size=None, pad=0, eos=1,
                               break_mode="eos")
    assert blocks.block_to_dataset_index.dtype.kind in "iu"  # (not float: offsets index arrays)
